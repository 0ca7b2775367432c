//! Tokenizers built from GGUF tokenizer metadata against reference ids, and chat templates.
//!
//! The vectors in tests/fixtures/tokenizer/ come from scripts/make-tokenizer-vectors.py:
//! each holds a [`TokenizerSpec`] and, for a varied corpus, the ids (special tokens added)
//! and decoded text of a reference tokenizer (HF `tokenizers`, or transformers' GGUF
//! tokenizer for the real SmolLM2-135M-Instruct metadata).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use graft::error::TemplateProblem;
use graft::models::text::chat::{ChatTemplate, Continuation, Message};
use graft::models::TokenizerSpec;
use graft::Error;
use serde::Deserialize;

#[derive(Deserialize)]
struct Vectors {
    spec: TokenizerSpec,
    cases: Vec<Case>,
    chat: Option<ChatCase>,
    /// Ids of the same corpus under other pre-tokenizer types (`tokenizer.ggml.pre`).
    #[serde(default)]
    variants: BTreeMap<String, Vec<Case>>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<MessageJson>,
    add_generation_prompt: bool,
    rendered: String,
}

#[derive(Deserialize)]
struct MessageJson {
    role: String,
    content: String,
}

fn vectors_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
}

fn load(name: &str) -> Vectors {
    let path = vectors_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every case encodes to the reference ids and decodes to the reference text.
fn check_cases(name: &str) -> Vectors {
    let v = load(name);
    check(name, &v.spec, &v.cases);
    v
}

fn check(name: &str, spec: &TokenizerSpec, cases: &[Case]) {
    let tok = spec.build().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let ids = tok.encode(&case.text).unwrap();
        if ids != case.ids {
            failures.push(format!(
                "{:?}\n  got  {ids:?}\n  want {:?}",
                case.text, case.ids
            ));
            continue;
        }
        let decoded = tok.decode(&ids).unwrap();
        if decoded != case.decoded {
            failures.push(format!("{:?} decodes to {decoded:?}", case.text));
        }
    }
    assert!(cases.len() > 10, "{name}: too few cases");
    assert!(failures.is_empty(), "{name}:\n{}", failures.join("\n"));
}

#[test]
fn byte_level_gpt2_pre_tokenizer_matches_reference() {
    check_cases("llama3-tiny-gpt2");
}

/// SmolLM2's vocabulary under the other pre-tokenizer types; the reference splits differ
/// from one type to the next on this corpus, so a wrong choice of regexes shows.
#[test]
fn byte_level_pre_tokenizer_types_match_reference() {
    let v = load("smollm2-135m-instruct");
    for pre in ["llama-bpe", "qwen2", "gpt-2", "default"] {
        let cases = v
            .variants
            .get(pre)
            .unwrap_or_else(|| panic!("no '{pre}' vectors"));
        let spec = TokenizerSpec {
            pre: Some(pre.into()),
            ..v.spec.clone()
        };
        check(pre, &spec, cases);
    }
    let differs = |a: &[Case], b: &[Case]| a.iter().zip(b).any(|(x, y)| x.ids != y.ids);
    assert!(differs(&v.cases, &v.variants["llama-bpe"]));
    assert!(differs(&v.cases, &v.variants["default"]));
}

#[test]
fn sentencepiece_matches_reference() {
    check_cases("llama2-tiny-spm");
}

/// The real SmolLM2-135M-Instruct metadata (pre-tokenizer `smollm`): ids and the chat
/// template against transformers.
#[test]
fn smollm2_matches_transformers() {
    let v = check_cases("smollm2-135m-instruct");
    let tok = v.spec.build().unwrap();
    let stop = tok.stop_ids();
    assert!(stop.contains(&v.spec.eos.unwrap()), "{stop:?}");
    let chat = v.chat.expect("the SmolLM2 vectors carry a chat case");
    let template = ChatTemplate::from_spec(&v.spec).unwrap();
    let messages: Vec<Message> = chat
        .messages
        .iter()
        .map(|m| Message::new(&m.role, &m.content))
        .collect();
    let rendered = template
        .render(&messages, chat.add_generation_prompt)
        .unwrap();
    assert_eq!(rendered, chat.rendered);
}

/// The chat loop's view: the cache holds the first turn's prompt and the reply with its
/// stop token; the second turn adds only new text, and prefix plus suffix tokenize like
/// the whole conversation.
#[test]
fn smollm2_incremental_turn() {
    let v = load("smollm2-135m-instruct");
    let tok = v.spec.build().unwrap();
    let template = ChatTemplate::from_spec(&v.spec).unwrap();
    let mut messages = vec![Message::new("user", "Hi!")];
    let first = template.render(&messages, true).unwrap();
    let reply = "Hello! How can I help?";
    let eos = tok.id_to_token(v.spec.eos.unwrap()).unwrap();
    let seen = format!("{first}{reply}{eos}");
    messages.push(Message::new("assistant", reply));
    messages.push(Message::new("user", "Tell me a joke."));
    let Continuation::Suffix(suffix) = template.append(&seen, &messages, true).unwrap() else {
        panic!("ChatML-style templates extend the earlier rendering");
    };
    assert!(suffix.starts_with('\n') && suffix.ends_with("<|im_start|>assistant\n"));
    let whole = tok
        .encode(&template.render(&messages, true).unwrap())
        .unwrap();
    let mut parts = tok.encode(&seen).unwrap();
    parts.extend(tok.encode(&suffix).unwrap());
    assert_eq!(parts, whole);
}

fn spec_err(spec: &TokenizerSpec) -> (&'static str, String) {
    match spec.build() {
        Err(Error::TokenizerSpec { key, msg }) => (key, msg),
        Err(e) => panic!("expected a tokenizer spec error, got {e}"),
        Ok(_) => panic!("expected an error"),
    }
}

/// Bad metadata gets an error naming its key, never a panic.
#[test]
fn bad_metadata_is_a_typed_error_naming_the_key() {
    let good = load("llama3-tiny-gpt2").spec;
    good.build().unwrap();
    let n = good.tokens.len() as u32;

    let (key, msg) = spec_err(&TokenizerSpec {
        model: "bert".into(),
        ..good.clone()
    });
    assert_eq!(key, "tokenizer.ggml.model");
    assert!(msg.contains("bert"), "{msg}");

    // A special-token id outside the vocabulary is unused, as in llama.cpp (a warning,
    // not an error): no stop id.
    let spec = TokenizerSpec {
        eos: Some(n),
        ..good.clone()
    };
    assert!(!spec.build().unwrap().stop_ids().contains(&n));

    let mut merges = good.merges.clone().unwrap();
    merges.push("Ġ nosuchtoken".into());
    let (key, msg) = spec_err(&TokenizerSpec {
        merges: Some(merges),
        ..good.clone()
    });
    assert_eq!(key, "tokenizer.ggml.merges");
    assert!(msg.contains("nosuchtoken"), "{msg}");

    let (key, _) = spec_err(&TokenizerSpec {
        merges: Some(vec!["nospace".into()]),
        ..good.clone()
    });
    assert_eq!(key, "tokenizer.ggml.merges");

    let mut types = good.token_types.clone().unwrap();
    types.pop();
    let (key, _) = spec_err(&TokenizerSpec {
        token_types: Some(types),
        ..good.clone()
    });
    assert_eq!(key, "tokenizer.ggml.token_type");

    let (key, _) = spec_err(&TokenizerSpec {
        pre: Some("no-such-pre".into()),
        ..good.clone()
    });
    assert_eq!(key, "tokenizer.ggml.pre");

    let spm = load("llama2-tiny-spm").spec;
    let (key, _) = spec_err(&TokenizerSpec {
        scores: Some(vec![0.0; 3]),
        ..spm
    });
    assert_eq!(key, "tokenizer.ggml.scores");
}

/// Parsing special tokens can be turned off: then `<|im_end|>` typed by a user is text.
#[test]
fn parse_special_off_tokenizes_control_text_as_text() {
    let spec = load("smollm2-135m-instruct").spec;
    let mut tok = spec.build().unwrap();
    let im_end = spec.eos.unwrap();
    assert_eq!(tok.encode("<|im_end|>").unwrap(), vec![im_end]);
    tok.set_parse_special(false);
    let ids = tok.encode("<|im_end|>").unwrap();
    assert!(ids.len() > 1 && !ids.contains(&im_end), "{ids:?}");
}

fn chat_err<T>(r: graft::Result<T>) -> (TemplateProblem, String) {
    match r {
        Err(Error::ChatTemplate { problem, detail }) => (problem, detail),
        Err(e) => panic!("expected a chat template error, got {e}"),
        Ok(_) => panic!("expected a chat template error"),
    }
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::new(None, "", "").unwrap();
    let messages = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi"),
    ];
    let text = t.render(&messages, true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert!(!t.render(&messages, false).unwrap().ends_with("assistant\n"));
}

/// `raise_exception` becomes [`TemplateProblem::Raised`] with its message; Python string
/// methods and `bos_token` work.
#[test]
fn template_raise_exception_and_python_methods() {
    let src = "{{ bos_token }}{% for m in messages %}\
        {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}\
        {% if m.content.strip().startswith('/') %}[cmd]{% endif %}{{ m.content.strip() }};{% endfor %}";
    let t = ChatTemplate::new(Some(src), "<s>", "</s>").unwrap();
    let ok = t
        .render(
            &[
                Message::new("user", "  /help "),
                Message::new("assistant", "x"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(ok, "<s>[cmd]/help;x;");
    let (problem, detail) = chat_err(t.render(&[Message::new("tool", "x")], false));
    assert_eq!(problem, TemplateProblem::Raised);
    assert!(detail.contains("bad role: tool"), "{detail}");
}

#[test]
fn malformed_template_is_a_typed_error() {
    let (problem, detail) = chat_err(ChatTemplate::new(
        Some("{% for m in messages %}{{ m.content }"),
        "",
        "",
    ));
    assert_eq!(problem, TemplateProblem::Syntax);
    assert!(!detail.is_empty());
    let t = ChatTemplate::new(Some("{{ messages | no_such_filter }}"), "", "");
    let (problem, _) = chat_err(t.and_then(|t| t.render(&[], false)));
    assert!(matches!(
        problem,
        TemplateProblem::Syntax | TemplateProblem::Render
    ));
}

/// A template that rewrites earlier turns is reported as diverged, with the full text.
#[test]
fn append_reports_a_rewritten_prefix() {
    let src = "{% for m in messages %}{% if loop.last %}{{ m.content }}{% else %}.{% endif %}{% endfor %}";
    let t = ChatTemplate::new(Some(src), "", "").unwrap();
    let first = t.render(&[Message::new("user", "abc")], false).unwrap();
    let two = [Message::new("user", "abc"), Message::new("user", "de")];
    assert_eq!(
        t.append(&first, &two, false).unwrap(),
        Continuation::Diverged(".de".into())
    );
    let chatml = ChatTemplate::new(None, "", "").unwrap();
    let one = chatml.render(&two[..1], false).unwrap();
    assert_eq!(
        chatml.append(&one, &two, false).unwrap(),
        Continuation::Suffix("<|im_start|>user\nde<|im_end|>\n".into())
    );
}

/// Streaming decoding of a tokenizer built from metadata gives the full decode, for
/// byte-level tokens of multi-byte characters and for SentencePiece word spaces.
#[test]
fn streaming_decode_of_spec_tokenizers() {
    for (name, text) in [
        ("smollm2-135m-instruct", "Café 日本の灯台 🌊 at night."),
        ("llama2-tiny-spm", "The river runs under the old bridge."),
    ] {
        let tok = load(name).spec.build().unwrap();
        let ids = tok.encode(text).unwrap();
        let mut stream = tok.stream(&ids[..1]).unwrap();
        let mut out = tok.decode(&ids[..1]).unwrap();
        for &id in &ids[1..] {
            out.extend(stream.next(id).unwrap());
        }
        assert_eq!(out, tok.decode(&ids).unwrap(), "{name}");
        assert_eq!(out, text, "{name}");
    }
}

/// A template that loops without end stops at the step limit, and one that repeats text
/// without bound stops at the output limit, each with its own problem; a long but real
/// conversation (20,000 messages) stays within both.
#[test]
fn runaway_templates_stop_with_named_limits() {
    let t = ChatTemplate::new(
        Some("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"),
        "",
        "",
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (problem, detail) = chat_err(t.render(&[], false));
    assert_eq!(problem, TemplateProblem::TooManySteps, "{detail}");
    assert!(started.elapsed().as_secs() < 60);

    let t = ChatTemplate::new(
        Some("{% for a in range(100000) %}{{ 'x' * 10000000 }}{% endfor %}"),
        "",
        "",
    )
    .unwrap();
    let (problem, detail) = chat_err(t.render(&[], false));
    assert_eq!(problem, TemplateProblem::TooLong, "{detail}");
    assert!(detail.contains(&graft::models::text::chat::MAX_RENDERED_BYTES.to_string()));

    let chatml = ChatTemplate::new(None, "", "").unwrap();
    let long: Vec<Message> = (0..20_000)
        .map(|i| {
            Message::new(
                if i % 2 == 0 { "user" } else { "assistant" },
                format!("turn {i}"),
            )
        })
        .collect();
    let text = chatml.render(&long, true).unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n"));
    assert!(text.contains("turn 19999<|im_end|>"));
}
