//! The crate's error type: every mistake a user can make (a shape, a dtype, a file, a
//! token id, a size) becomes an [`Error`] that names the problem, never a panic; and
//! [`warn_once`] for what a loader accepts but leaves unused.

use crate::graph::DType;

/// Result alias used throughout graft.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while building, planning or running a graph, or while
/// loading a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An op was given operands of incompatible shapes.
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },

    /// An op was given an operand of a dtype it does not accept.
    #[error("{op}: operand '{operand}' has dtype {found}, expected {expected}")]
    DType {
        op: &'static str,
        operand: String,
        found: DType,
        expected: String,
    },

    /// A tensor id that does not belong to this graph (or was removed from it).
    #[error("tensor id {0} does not belong to this graph")]
    UnknownTensor(String),

    /// An index read from a tensor at run time is out of range (a token id, a row id).
    #[error("{op} '{node}': index {index} at position {position} is out of range 0..{limit}")]
    IndexOutOfRange {
        op: &'static str,
        node: String,
        index: i64,
        position: usize,
        limit: usize,
    },

    /// A graph could not be planned or executed as asked (a missing input, an output that
    /// was not requested, a buffer too small for the tensor placed in it, ...).
    #[error("{0}")]
    Plan(String),

    /// A backend cannot run a node of the graph.
    #[error("backend {backend} does not support node '{node}' ({op}): {reason}")]
    Unsupported {
        backend: &'static str,
        node: String,
        op: &'static str,
        reason: String,
    },

    /// A member of a device group gave up on a run because another member failed
    /// (that member's own error says why).
    #[error("another device of the group failed; this device's run was abandoned")]
    Abandoned,

    /// No usable device: no driver, no GPU, or the GPU library failed to load.
    #[error("no device: {0}")]
    NoDevice(String),

    /// A failure inside a backend (a driver error, out of device memory, a failed launch).
    #[error("{backend}: {msg}")]
    Backend { backend: &'static str, msg: String },

    /// A model file or folder is malformed or does not match the expected layout.
    #[error("{0}")]
    Model(String),

    /// A GGUF file is malformed: the field that is wrong and its byte offset in the file.
    #[error("{path}: {field} at byte {offset}: {msg}")]
    Gguf {
        path: String,
        field: String,
        offset: u64,
        msg: String,
    },

    /// A GGUF value asked for or given is wrong: a metadata key that is missing or of
    /// another type, a tensor given to the writer whose shape and bytes disagree.
    #[error("{field}: {msg}")]
    GgufInput { field: String, msg: String },

    /// Tokenizer metadata (the GGUF `tokenizer.*` keys) that cannot describe a tokenizer:
    /// `key` names the offending key.
    #[error("{key}: {msg}")]
    TokenizerSpec { key: &'static str, msg: String },

    /// A chat template that cannot be parsed or rendered, or that raised an exception.
    #[error("chat template: {problem}: {detail}")]
    ChatTemplate {
        problem: TemplateProblem,
        detail: String,
    },

    /// A forward pass produced logits that are not finite (NaN or an infinity: weights
    /// holding NaN/Inf, or an overflow), at the token position named; generation stops
    /// rather than sample from them.
    #[error("non-finite logits (NaN or infinity) at token position {position} ({step}): the weights hold NaN/Inf or the computation overflowed")]
    NonFinite {
        /// The token position whose logits are not finite.
        position: usize,
        /// The step: `prefill` or `decode`.
        step: &'static str,
    },

    /// A generation request the engine cannot take (an empty prompt, a token outside the
    /// vocabulary, more tokens than the context or the KV budget holds): `param` names
    /// the request field (`prompt`, `max_tokens`) and `code` the kind of problem
    /// (`context_length_exceeded`, `invalid_value`), so a server can answer with both.
    #[error("{param}: {msg}")]
    Request {
        param: &'static str,
        code: &'static str,
        msg: String,
    },

    /// A sampling setting out of its range (a temperature below 0, a top-p above 1, a
    /// logit bias for a token outside the vocabulary): `param` is the setting's name as
    /// in [`SamplingParams`](crate::models::SamplingParams) (`top_p`), so a server can
    /// name the request field.
    #[error("sampling setting {param}: {msg}")]
    Sampling { param: &'static str, msg: String },

    /// The default model could not be pulled into the cache: python3 or pip missing, the
    /// download failed, or the file's hash is wrong.
    #[error("pull: {0}")]
    Pull(String),

    /// An I/O error, with the path it concerns.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// What went wrong with a chat template (see [`Error::ChatTemplate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateProblem {
    /// The template does not parse (a Jinja syntax error).
    Syntax,
    /// Rendering failed (an undefined function or filter, a type error, ...).
    Render,
    /// The template called `raise_exception` (it rejects the conversation).
    Raised,
    /// Rendering took more than [`crate::models::text::chat::MAX_TEMPLATE_STEPS`] steps (a
    /// template that loops without end).
    TooManySteps,
    /// The rendered text passed [`crate::models::text::chat::MAX_RENDERED_BYTES`].
    TooLong,
}

impl std::fmt::Display for TemplateProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TemplateProblem::Syntax => "syntax error",
            TemplateProblem::Render => "render error",
            TemplateProblem::Raised => "the template raised an exception",
            TemplateProblem::TooManySteps => "the template took too many steps",
            TemplateProblem::TooLong => "the rendered text is too long",
        })
    }
}

impl Error {
    /// Shorthand for a shape error.
    pub fn shape(op: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape {
            op,
            msg: msg.into(),
        }
    }

    /// Shorthand for a planning error.
    pub fn plan(msg: impl Into<String>) -> Self {
        Error::Plan(msg.into())
    }

    /// Shorthand for a tokenizer metadata error naming its key.
    pub fn tokenizer_spec(key: &'static str, msg: impl Into<String>) -> Self {
        Error::TokenizerSpec {
            key,
            msg: msg.into(),
        }
    }

    /// Shorthand for a sampling error naming its setting.
    pub fn sampling(param: &'static str, msg: impl Into<String>) -> Self {
        Error::Sampling {
            param,
            msg: msg.into(),
        }
    }

    /// Shorthand for a model error.
    pub fn model(msg: impl Into<String>) -> Self {
        Error::Model(msg.into())
    }

    /// Shorthand for a request error naming its field and the kind of problem.
    pub fn request(param: &'static str, code: &'static str, msg: impl Into<String>) -> Self {
        Error::Request {
            param,
            code,
            msg: msg.into(),
        }
    }

    /// Shorthand for a pull error.
    pub fn pull(msg: impl Into<String>) -> Self {
        Error::Pull(msg.into())
    }

    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}

/// Prints `warning: {msg}` on stderr the first time this process meets `msg`: for what a
/// loader accepts but does not use (a special-token id outside the vocabulary, which
/// Hugging Face transformers and llama.cpp accept too), however often the file is read.
pub fn warn_once(msg: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if !seen.iter().any(|m| m == msg) {
        seen.push(msg.to_string());
        eprintln!("warning: {msg}");
    }
}
