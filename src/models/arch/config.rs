//! A model's hyper-parameters, read from a Hugging Face `config.json`: the architecture
//! from `model_type` (see [`Arch`]; Llama when absent), the sizes under the names that
//! architecture's configs use ([`HfKeys`](crate::models::arch::HfKeys): `hidden_size` or GPT-2's
//! `n_embd`, ...), and Mistral's `sliding_window`.
//!
//! Both forms of the rope settings are understood: the classic `rope_theta` +
//! `rope_scaling` (`{"rope_type" | "type": "llama3", factor, low_freq_factor,
//! high_freq_factor, original_max_position_embeddings}`, `"default"` or null), and the
//! `rope_parameters` object written by transformers 5 (`{"rope_type", "rope_theta", ...}`).
//! `eos_token_id` may be an integer or a list; the dtype comes from `dtype` or
//! `torch_dtype`. Every bad or missing field is an [`Error::Model`] naming the field and
//! the file. A `bos_token_id` or `eos_token_id` that is an integer outside the vocabulary
//! (HF's GPT-2 defaults, 50256, in a smaller vocabulary; -1 for none) is accepted, as
//! transformers accepts it, and left unused with a warning: without an EOS id, generation
//! runs to its `-n` tokens (or a chat template's end of turn). So is a `dtype` /
//! `torch_dtype` other than float32, float16 and bfloat16.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::ops::{Llama3Scaling, RopeMode, RopeParams};

use crate::models::arch::{Arch, HfKeys};

/// Default `rope_theta` of transformers' `LlamaConfig`, used when the file has none.
pub const DEFAULT_ROPE_THETA: f32 = 10_000.0;

/// How a router's logits become the selected experts' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts (Qwen3-MoE, Mixtral).
    Softmax,
    /// A sigmoid of each logit (llama.cpp's `expert_gating_func` 2).
    Sigmoid,
}

/// A mixture of experts in place of every block's MLP: a router scores `n_expert`
/// SwiGLU experts (each [`Config::intermediate_size`] wide), each token goes through the
/// `n_used` best, and the block's output is their outputs' weighted sum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    /// Experts per block.
    pub n_expert: usize,
    /// Experts per token (the router's top k).
    pub n_used: usize,
    /// How the logits become weights.
    pub gating: Gating,
    /// Whether the selected experts' weights are scaled to sum to 1.
    pub norm_topk: bool,
}

impl Moe {
    /// Checks the counts (`source` and `fields` name them in errors): at least one
    /// expert, and `1 <= n_used <= n_expert`.
    pub fn check(&self, source: &str, fields: [&str; 2]) -> Result<()> {
        if self.n_expert == 0 || self.n_used == 0 || self.n_used > self.n_expert {
            return Err(Error::model(format!(
                "{source}: field '{}' is {} and '{}' is {}: a mixture of experts needs 1 <= experts per token <= experts",
                fields[0], self.n_expert, fields[1], self.n_used
            )));
        }
        Ok(())
    }
}

/// Model hyper-parameters (names follow the HF Llama config).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The architecture: which blocks the layers use and how files name things.
    pub arch: Arch,
    /// Width of the residual stream (`n_embd`).
    pub hidden_size: usize,
    /// Width of the MLP (`n_ff`); of each expert's MLP in a mixture of experts.
    pub intermediate_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Dimension of one head (`hidden_size / num_attention_heads` unless given).
    pub head_dim: usize,
    /// Epsilon of every norm (RMSNorm or LayerNorm, as the architecture says).
    pub norm_eps: f32,
    /// Rows of the embedding table and of the output projection.
    pub vocab_size: usize,
    /// The longest context the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the output projection is the embedding table.
    pub tie_word_embeddings: bool,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's declared dtype (`dtype` / `torch_dtype`), if any.
    pub dtype: Option<DType>,
    /// Rope frequency base.
    pub rope_theta: f32,
    /// Llama 3 rope frequency scaling, if any.
    pub rope_scaling: Option<Llama3Scaling>,
    /// Sliding-window attention (Mistral): a query at position `i` sees keys
    /// `i - window < j <= i`.
    pub sliding_window: Option<usize>,
    /// The mixture of experts in place of every MLP, if the architecture has one.
    pub moe: Option<Moe>,
    /// Devices the model is split over (tensor parallelism, [`Split`](crate::models::arch::tp::Split)):
    /// 1 for the whole model; above 1 this is one device's share, whose head counts and
    /// `intermediate_size` are that share's, and whose graphs sum the devices' partial
    /// projections with `all_reduce`.
    pub tp: usize,
}

impl Config {
    /// Reads and checks `config.json` at `path`.
    pub fn from_file(path: &Path) -> Result<Config> {
        let text = crate::files::read_regular_to_string(path)?;
        Config::from_json_str(&text, &path.display().to_string())
    }

    /// Parses a config from JSON text; `source` names the file in error messages.
    pub fn from_json_str(text: &str, source: &str) -> Result<Config> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| Error::model(format!("{source}: not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::model(format!("{source}: expected a JSON object")));
        };
        let f = Fields { map: &map, source };
        let arch = f.arch()?;
        let spec = arch.spec();
        let keys = spec.hf_keys;
        f.check_supported(arch)?;

        let hidden_size = f.usize(keys.hidden)?;
        let (num_attention_heads, num_key_value_heads, head_dim) = f.heads(&keys, hidden_size)?;
        let norm_eps = f.f32(keys.eps)?;
        if !(norm_eps.is_finite() && norm_eps > 0.0) {
            return Err(f.bad(keys.eps, format!("{norm_eps} must be > 0")));
        }
        let intermediate_size = match (f.opt_usize(keys.intermediate)?, keys.ff_default_4x) {
            (Some(n), _) => n,
            (None, true) => hidden_size
                .checked_mul(4)
                .ok_or_else(|| f.bad(keys.hidden, format!("{hidden_size} is too large")))?,
            (None, false) => return Err(f.bad(keys.intermediate, "is missing")),
        };
        let (rope_theta, rope_scaling) = f.rope()?;
        let vocab_size = f.usize("vocab_size")?;
        let config = Config {
            arch,
            hidden_size,
            intermediate_size,
            num_hidden_layers: f.usize(keys.layers)?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            norm_eps,
            vocab_size,
            max_position_embeddings: f.usize(keys.max_pos)?,
            tie_word_embeddings: f
                .opt_bool("tie_word_embeddings")?
                .unwrap_or(arch == Arch::Gpt2),
            bos_token_id: f.bos(vocab_size)?,
            eos_token_ids: f.eos(vocab_size)?,
            dtype: f.dtype()?,
            rope_theta,
            rope_scaling,
            sliding_window: f.sliding_window(arch)?,
            moe: f.moe(arch)?,
            tp: 1,
        };
        Ok(config)
    }

    /// Experts per block (0 without a mixture of experts).
    pub fn n_expert(&self) -> usize {
        self.moe.map_or(0, |m| m.n_expert)
    }

    /// Query width: `num_attention_heads * head_dim`.
    pub fn n_q(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Key (and value) width: `num_key_value_heads * head_dim`.
    pub fn n_kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The rope of every layer: NeoX pairing (HF's rotate-half, which is how HF Llama
    /// checkpoints are laid out, so no weight permutation is needed) over the whole head.
    pub fn rope(&self) -> RopeParams {
        RopeParams {
            llama3: self.rope_scaling,
            ..RopeParams::new(RopeMode::Neox, self.head_dim, self.rope_theta)
        }
    }

    /// Whether `token` ends generation.
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos_token_ids.contains(&token)
    }
}

/// Typed access to the fields of one config object, with errors naming field and file.
struct Fields<'a> {
    map: &'a Map<String, Value>,
    source: &'a str,
}

impl Fields<'_> {
    fn bad(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        Error::model(format!("{}: field '{field}' {msg}", self.source))
    }

    fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 => Ok(Some(n as usize)),
                _ => Err(self.bad(field, format!("must be a positive integer, found {v}"))),
            },
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.opt_usize(field)?
            .ok_or_else(|| self.bad(field, "is missing"))
    }

    fn f32(&self, field: &str) -> Result<f32> {
        let v = self
            .get(field)
            .ok_or_else(|| self.bad(field, "is missing"))?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.bad(field, format!("must be a number, found {v}")))
    }

    fn opt_bool(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(field, format!("must be true or false, found {v}"))),
        }
    }

    /// A special-token id of `field`: an integer (else an error); one outside the
    /// vocabulary of `vocab` tokens is `None`, with a warning saying what is done
    /// without it (`unused`).
    fn special_token(
        &self,
        field: &str,
        v: &Value,
        vocab: usize,
        unused: &str,
    ) -> Result<Option<u32>> {
        let id = match (v.as_u64(), v.as_i64()) {
            (Some(n), _) => i128::from(n),
            (None, Some(n)) => i128::from(n),
            (None, None) => return Err(self.bad(field, format!("must be a token id, found {v}"))),
        };
        match u32::try_from(id).ok().filter(|&id| (id as usize) < vocab) {
            Some(id) => Ok(Some(id)),
            None => {
                crate::error::warn_once(&format!(
                    "{}: field '{field}' {id} is not a token of the vocabulary (vocab_size {vocab}); {unused}",
                    self.source
                ));
                Ok(None)
            }
        }
    }

    fn bos(&self, vocab: usize) -> Result<Option<u32>> {
        let unused = "graft does not use it (the tokenizer's own settings add BOS)";
        match self.get("bos_token_id") {
            None => Ok(None),
            Some(v) => self.special_token("bos_token_id", v, vocab, unused),
        }
    }

    fn eos(&self, vocab: usize) -> Result<Vec<u32>> {
        let unused =
            "it is not used: generation stops at -n tokens (or a chat template's end of turn)";
        let one = |v| self.special_token("eos_token_id", v, vocab, unused);
        match self.get("eos_token_id") {
            None => Ok(Vec::new()),
            Some(Value::Array(list)) => list.iter().filter_map(|v| one(v).transpose()).collect(),
            Some(v) => Ok(one(v)?.into_iter().collect()),
        }
    }

    /// `dtype`, else `torch_dtype`; both are checked when both are present. A type name
    /// graft has no use for (`float64`, `int8`: transformers accepts any) is not used,
    /// with a warning: it only says what the checkpoint was saved from, and the weights'
    /// own types are what is loaded. A value that is not a string is an error.
    fn dtype(&self) -> Result<Option<DType>> {
        let mut found = None;
        for field in ["dtype", "torch_dtype"] {
            let Some(v) = self.get(field) else { continue };
            let dt = match v.as_str() {
                Some("float32") => Some(DType::F32),
                Some("float16") => Some(DType::F16),
                Some("bfloat16") => Some(DType::BF16),
                Some(other) => {
                    crate::error::warn_once(&format!(
                        "{}: field '{field}' is \"{other}\", not float32, float16 or bfloat16; it is not used (the weights' own types are loaded)",
                        self.source
                    ));
                    None
                }
                None => return Err(self.bad(field, format!("must be a type name, found {v}"))),
            };
            found = found.or(dt);
        }
        Ok(found)
    }

    /// The architecture named by `model_type` (Llama when the field is absent).
    fn arch(&self) -> Result<Arch> {
        match self.get("model_type") {
            None => Ok(Arch::Llama),
            Some(v) => v
                .as_str()
                .and_then(Arch::from_hf_model_type)
                .ok_or_else(|| {
                    self.bad("model_type", format!("is {v}; supported: {}", Arch::list()))
                }),
        }
    }

    /// Rejects settings this implementation would silently get wrong.
    fn check_supported(&self, arch: Arch) -> Result<()> {
        let spec = arch.spec();
        for field in ["hidden_act", "activation_function"] {
            if let Some(v) = self.get(field) {
                if !v.as_str().is_some_and(|a| spec.hf_acts.contains(&a)) {
                    return Err(self.bad(
                        field,
                        format!("is {v}; {arch} runs {}", spec.hf_acts.join(", ")),
                    ));
                }
            }
        }
        let biases = [
            ("attention_bias", spec.qkv_bias && spec.out_bias),
            ("mlp_bias", spec.mlp_bias),
        ];
        for (field, has) in biases {
            if self.opt_bool(field)? == Some(true) && !has {
                return Err(self.bad(
                    field,
                    format!("is true; {arch} models have no such biases in graft"),
                ));
            }
        }
        Ok(())
    }

    /// `(num_attention_heads, num_key_value_heads, head_dim)`: the head dim given, else
    /// the hidden size over the heads; the KV heads dividing the heads, the head dim even.
    fn heads(&self, keys: &HfKeys, hidden_size: usize) -> Result<(usize, usize, usize)> {
        let heads = self.usize(keys.heads)?;
        let kv_heads = match keys.kv_heads {
            Some(k) => self.opt_usize(k)?.unwrap_or(heads),
            None => heads,
        };
        let head_dim = match self.opt_usize("head_dim")? {
            Some(d) => d,
            None if !hidden_size.is_multiple_of(heads) => {
                return Err(self.bad(
                    "head_dim",
                    format!(
                        "is missing and {} {hidden_size} is not a multiple of {} {heads}",
                        keys.hidden, keys.heads
                    ),
                ))
            }
            None => hidden_size / heads,
        };
        if heads % kv_heads != 0 {
            return Err(self.bad(
                keys.kv_heads.unwrap_or(keys.heads),
                format!("{kv_heads} must divide {} {heads}", keys.heads),
            ));
        }
        if head_dim % 2 != 0 {
            return Err(self.bad(
                "head_dim",
                format!("{head_dim} must be even (rope rotates pairs)"),
            ));
        }
        Ok((heads, kv_heads, head_dim))
    }

    /// The sliding window: Mistral's `sliding_window`; Qwen's only when
    /// `use_sliding_window` is true, which graft does not run (its windows depend on the
    /// layer).
    fn sliding_window(&self, arch: Arch) -> Result<Option<usize>> {
        match arch {
            Arch::Mistral | Arch::Mixtral => self.opt_usize("sliding_window"),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
                match self.opt_bool("use_sliding_window")? {
                    Some(true) => Err(self.bad(
                        "use_sliding_window",
                        "is true; per-layer sliding windows (max_window_layers) are not supported",
                    )),
                    Some(false) | None => Ok(None),
                }
            }
            Arch::Llama | Arch::Gpt2 => Ok(None),
        }
    }

    /// The mixture of experts of an architecture that has one: the counts under its
    /// keys, softmax gating, renormalised where the architecture always does or its
    /// flag says so. Qwen-MoE configs whose blocks are not all sparse
    /// (`decoder_sparse_step` other than 1, `mlp_only_layers`) are refused.
    fn moe(&self, arch: Arch) -> Result<Option<Moe>> {
        let Some(keys) = arch.spec().experts else {
            return Ok(None);
        };
        if let Some(step) = self.opt_usize("decoder_sparse_step")?.filter(|&s| s != 1) {
            return Err(self.bad(
                "decoder_sparse_step",
                format!(
                    "is {step}; graft runs models whose every block is a mixture of experts (1)"
                ),
            ));
        }
        if let Some(v) = self.get("mlp_only_layers").filter(|v| !v.is_null()) {
            if v.as_array().is_none_or(|a| !a.is_empty()) {
                return Err(self.bad(
                    "mlp_only_layers",
                    format!(
                        "is {v}; graft runs models whose every block is a mixture of experts ([])"
                    ),
                ));
            }
        }
        let norm_topk = match keys.hf_norm {
            Some(field) => self.opt_bool(field)?.unwrap_or(false),
            None => true,
        };
        let count = keys
            .hf_count
            .iter()
            .copied()
            .find(|f| self.get(f).is_some())
            .unwrap_or(keys.hf_count[0]);
        let moe = Moe {
            n_expert: self.usize(count)?,
            n_used: self.usize(keys.hf_used)?,
            gating: Gating::Softmax,
            norm_topk,
        };
        moe.check(self.source, [count, keys.hf_used])?;
        Ok(Some(moe))
    }

    /// `(rope_theta, llama3 scaling)` from either form of the rope settings.
    fn rope(&self) -> Result<(f32, Option<Llama3Scaling>)> {
        // Checked even where rope_parameters overrides it: a bad field is never ignored.
        let top_theta = self.opt_f32("rope_theta")?;
        let (prefix, obj, theta) = match self.get("rope_parameters") {
            Some(Value::Object(rp)) => {
                let f = Fields {
                    map: rp,
                    source: self.source,
                };
                let theta = match f.get("rope_theta") {
                    Some(_) => f
                        .f32("rope_theta")
                        .map_err(|_| self.bad("rope_parameters.rope_theta", "must be a number"))?,
                    None => top_theta.unwrap_or(DEFAULT_ROPE_THETA),
                };
                ("rope_parameters", Some(rp), theta)
            }
            Some(v) => {
                return Err(self.bad("rope_parameters", format!("must be an object, found {v}")))
            }
            None => {
                let theta = top_theta.unwrap_or(DEFAULT_ROPE_THETA);
                match self.get("rope_scaling") {
                    None => ("rope_scaling", None, theta),
                    Some(Value::Object(rs)) => ("rope_scaling", Some(rs), theta),
                    Some(v) => {
                        return Err(self.bad(
                            "rope_scaling",
                            format!("must be an object or null, found {v}"),
                        ))
                    }
                }
            }
        };
        if !(theta.is_finite() && theta > 0.0) {
            return Err(self.bad("rope_theta", format!("{theta} must be > 0")));
        }
        let Some(obj) = obj else {
            return Ok((theta, None));
        };
        let kind = obj
            .get("rope_type")
            .or_else(|| obj.get("type"))
            .filter(|v| !v.is_null());
        let scaling = match kind.map(|v| v.as_str()) {
            None | Some(Some("default")) => None,
            Some(Some("llama3")) => Some(self.llama3_scaling(obj, prefix)?),
            Some(_) => {
                return Err(self.bad(
                    &format!("{prefix}.rope_type"),
                    format!(
                        "is {}; supported: \"default\", \"llama3\"",
                        kind.map_or(Value::Null, Clone::clone)
                    ),
                ))
            }
        };
        Ok((theta, scaling))
    }

    /// Llama 3's rope scaling from the object `obj` (the field `prefix`): factor > 0,
    /// 0 < low_freq_factor < high_freq_factor, original_max_position_embeddings > 0.
    fn llama3_scaling(&self, obj: &Map<String, Value>, prefix: &str) -> Result<Llama3Scaling> {
        let num = |key: &str| -> Result<f64> {
            obj.get(key)
                .and_then(Value::as_f64)
                .ok_or_else(|| self.bad(&format!("{prefix}.{key}"), "is missing or not a number"))
        };
        let s = Llama3Scaling {
            factor: num("factor")? as f32,
            low_freq_factor: num("low_freq_factor")? as f32,
            high_freq_factor: num("high_freq_factor")? as f32,
            original_max_position: num("original_max_position_embeddings")? as usize,
        };
        if !(s.factor > 0.0
            && s.low_freq_factor > 0.0
            && s.high_freq_factor > s.low_freq_factor
            && s.original_max_position > 0)
        {
            return Err(self.bad(
                prefix,
                format!("has invalid llama3 values {s:?}: need factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_position_embeddings > 0"),
            ));
        }
        Ok(s)
    }

    fn opt_f32(&self, field: &str) -> Result<Option<f32>> {
        self.get(field).map(|_| self.f32(field)).transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{
        "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 4, "rms_norm_eps": 1e-5, "vocab_size": 512,
        "max_position_embeddings": 512"#;

    fn parse(extra: &str) -> Result<Config> {
        Config::from_json_str(&format!("{BASE}{extra}}}"), "test/config.json")
    }

    fn err(extra: &str) -> String {
        parse(extra).unwrap_err().to_string()
    }

    #[test]
    fn defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, DEFAULT_ROPE_THETA);
        assert_eq!(c.rope_scaling, None);
        assert!(!c.tie_word_embeddings);
        assert!(c.eos_token_ids.is_empty());
        assert_eq!(c.dtype, None);
    }

    #[test]
    fn classic_rope_scaling_with_type_key() {
        let c = parse(
            r#", "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": [7, 9],
            "rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 1,
            "high_freq_factor": 4, "original_max_position_embeddings": 8192}"#,
        )
        .unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.dtype, Some(DType::BF16));
        assert_eq!(c.eos_token_ids, vec![7, 9]);
        let s = c.rope_scaling.unwrap();
        assert_eq!((s.factor, s.original_max_position), (8.0, 8192));
        assert!(c.is_eos(9) && !c.is_eos(8));
    }

    #[test]
    fn rope_parameters_form() {
        let c = parse(
            r#", "dtype": "float16", "eos_token_id": 3, "head_dim": 32,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 250000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
        )
        .unwrap();
        assert_eq!(c.rope_theta, 250000.0);
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.n_q(), 128);
        assert_eq!(c.rope_scaling.unwrap().factor, 32.0);
        assert_eq!(c.rope().n_dims, 32);
        let plain =
            parse(r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}"#).unwrap();
        assert_eq!((plain.rope_theta, plain.rope_scaling), (1e4, None));
    }

    #[test]
    fn gpt2_keys_and_defaults() {
        let c = Config::from_json_str(
            r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "n_positions": 128, "layer_norm_epsilon": 1e-5, "vocab_size": 512,
            "activation_function": "gelu_new"}"#,
            "g/config.json",
        )
        .unwrap();
        assert_eq!(c.arch, Arch::Gpt2);
        assert_eq!(
            (c.hidden_size, c.intermediate_size),
            (64, 256),
            "n_inner: 4 x n_embd"
        );
        assert_eq!((c.num_key_value_heads, c.head_dim), (4, 16));
        assert_eq!(c.max_position_embeddings, 128);
        assert!(c.tie_word_embeddings, "GPT-2 ties by default");
        let relu = r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "n_positions": 128, "layer_norm_epsilon": 1e-5, "vocab_size": 512,
            "activation_function": "relu"}"#;
        let e = Config::from_json_str(relu, "g/config.json").unwrap_err();
        assert!(e.to_string().contains("'activation_function'"), "{e}");
    }

    #[test]
    fn mistral_window_and_qwen_types() {
        let m = parse(r#", "model_type": "mistral", "sliding_window": 4096"#).unwrap();
        assert_eq!((m.arch, m.sliding_window), (Arch::Mistral, Some(4096)));
        let m = parse(r#", "model_type": "mistral", "sliding_window": null"#).unwrap();
        assert_eq!(m.sliding_window, None);
        let q = parse(
            r#", "model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": false"#,
        )
        .unwrap();
        assert_eq!((q.arch, q.sliding_window), (Arch::Qwen3, None));
        assert_eq!(parse("").unwrap().arch, Arch::Llama);
    }

    /// HF's GPT-2 defaults (50256) in a smaller vocabulary, or -1 for none: accepted, as
    /// transformers accepts them, and not used.
    #[test]
    fn special_token_ids_outside_the_vocabulary_are_unused() {
        let c = parse(r#", "bos_token_id": 50256, "eos_token_id": [600, 7, -1]"#).unwrap();
        assert_eq!((c.bos_token_id, c.eos_token_ids), (None, vec![7]));
        let c = parse(r#", "bos_token_id": 1, "eos_token_id": 4294967296"#).unwrap();
        assert_eq!((c.bos_token_id, c.eos_token_ids), (Some(1), vec![]));
    }

    #[test]
    fn bad_fields_are_named() {
        let missing = Config::from_json_str(r#"{"hidden_size": 8}"#, "x/config.json").unwrap_err();
        assert!(missing.to_string().contains("x/config.json"), "{missing}");
        assert!(err(r#", "head_dim": "abc""#).contains("'head_dim'"));
        assert!(err(r#", "num_key_value_heads": 3"#).contains("'num_key_value_heads'"));
        assert!(
            err(r#", "rope_scaling": {"rope_type": "yarn", "factor": 4}"#)
                .contains("rope_scaling.rope_type")
        );
        assert!(
            err(r#", "rope_scaling": {"rope_type": "llama3", "factor": 8}"#)
                .contains("rope_scaling.low_freq_factor")
        );
        assert!(
            err(r#", "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}"#)
                .contains("rope_parameters.factor")
        );
        assert!(err(r#", "eos_token_id": [1, "x"]"#).contains("'eos_token_id'"));
        assert!(err(r#", "bos_token_id": 1.5"#).contains("'bos_token_id'"));
        assert!(err(r#", "torch_dtype": 16"#).contains("'torch_dtype'"));
        assert_eq!(parse(r#", "torch_dtype": "int8""#).unwrap().dtype, None);
        assert!(err(r#", "hidden_act": "gelu""#).contains("'hidden_act'"));
        assert!(err(r#", "attention_bias": true"#).contains("'attention_bias'"));
        assert!(err(r#", "model_type": "bert""#).contains("'model_type'"));
        let qwen_window = r#", "model_type": "qwen2", "use_sliding_window": true"#;
        assert!(err(qwen_window).contains("'use_sliding_window'"));
        assert!(err(r#", "rms_norm_eps": -1"#).contains("'rms_norm_eps'"));
    }
}
