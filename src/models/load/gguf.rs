//! Models from GGUF files as llama.cpp's converter writes them (architectures `llama`,
//! `qwen2`, `qwen3`, `qwen3moe`, `gpt2`; Mistral is a `llama` file with a sliding window,
//! Mixtral one with `llama.expert_count`): the hyper-parameters from the `{arch}.*` keys,
//! the weights from llama.cpp's tensor names (`token_embd`, `position_embd`,
//! `blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_qkv,attn_q_norm,attn_k_norm,attn_output,
//! ffn_norm,ffn_gate,ffn_up,ffn_down,ffn_gate_inp,ffn_gate_exps,ffn_up_exps,ffn_down_exps}`
//! with `.weight` and `.bias`, `output_norm`, and `output`, absent when tied to
//! `token_embd`).
//!
//! **Rope layout.** For its `llama` architecture, llama.cpp's converter permutes the rows
//! of every head of `attn_q` and `attn_k` so that the rotated pairs are adjacent (ggml's "normal" rope), while
//! graft's Llama applies NeoX-style rope to the HF layout (pairs half a head apart).
//! graft un-permutes Q and K rows while loading ([`permute_rope_rows`]): rows move whole,
//! so this is exact in every dtype, and one graph (and one set of kernels) serves HF and
//! GGUF models alike. `graft convert` applies the forward permutation, and the round trip
//! HF -> GGUF -> graft gives the HF folder's logits (tests/cli/gguf_model.rs).
//!
//! **Llama 3 rope scaling.** The converter stores it as a tensor `rope_freqs.weight` (a
//! divisor of each pair's frequency) rather than as parameters. graft reads the
//! parameters from the `graft.rope.llama3.*` keys that `graft convert` writes; without
//! them it fits the Llama 3.1 parameters (low 1, high 4, original context 8192, factor
//! the largest divisor) and accepts them only if they reproduce every divisor.
//!
//! Every key, tensor, type and shape is checked before the weight buffer is allocated;
//! errors name the file and the key or tensor.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile};
use crate::graph::{BufferId, DType};
use crate::ops::{Llama3Scaling, RopeMode, RopeParams};
use crate::quant::QType;

use crate::models::arch::config::{Config, Gating, Moe, DEFAULT_ROPE_THETA};
use crate::models::arch::role::Role;
use crate::models::arch::tp::Split;
use crate::models::arch::{Arch, NormKind};
use crate::models::load::options::LoadOptions;
use crate::models::load::rows::{permute_rope_rows, source_bytes, source_shape};
use crate::models::load::safetensors::{fallback_notes, upload};
use crate::models::load::weights::{check_sizes, layers_named, uniform, SizeFields, Weights};

/// The keys `graft convert` writes for Llama 3 rope scaling (llama.cpp reads
/// `rope_freqs.weight` instead and ignores these).
pub mod llama3_keys {
    /// `factor`.
    pub const FACTOR: &str = "graft.rope.llama3.factor";
    /// `low_freq_factor`.
    pub const LOW: &str = "graft.rope.llama3.low_freq_factor";
    /// `high_freq_factor`.
    pub const HIGH: &str = "graft.rope.llama3.high_freq_factor";
    /// `original_max_position_embeddings`.
    pub const ORIGINAL: &str = "graft.rope.llama3.original_context_length";
}

/// The name of llama.cpp's rope frequency divisors tensor.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// graft's dtype for a GGUF tensor type, if graft supports it for weights: the float
/// types and every block type of [`QType`] but Q8_1 (an activation format).
pub fn weight_dtype(t: GgmlType) -> Option<DType> {
    let q = |q: QType| Some(DType::Quant(q));
    match t {
        GgmlType::F32 => Some(DType::F32),
        GgmlType::F16 => Some(DType::F16),
        GgmlType::BF16 => Some(DType::BF16),
        GgmlType::Q4_0 => q(QType::Q4_0),
        GgmlType::Q4_1 => q(QType::Q4_1),
        GgmlType::Q5_0 => q(QType::Q5_0),
        GgmlType::Q5_1 => q(QType::Q5_1),
        GgmlType::Q8_0 => q(QType::Q8_0),
        GgmlType::Q2_K => q(QType::Q2_K),
        GgmlType::Q3_K => q(QType::Q3_K),
        GgmlType::Q4_K => q(QType::Q4_K),
        GgmlType::Q5_K => q(QType::Q5_K),
        GgmlType::Q6_K => q(QType::Q6_K),
        GgmlType::IQ2_XXS => q(QType::IQ2_XXS),
        GgmlType::IQ2_XS => q(QType::IQ2_XS),
        GgmlType::IQ3_XXS => q(QType::IQ3_XXS),
        GgmlType::IQ1_S => q(QType::IQ1_S),
        GgmlType::IQ4_NL => q(QType::IQ4_NL),
        GgmlType::IQ3_S => q(QType::IQ3_S),
        GgmlType::IQ2_S => q(QType::IQ2_S),
        GgmlType::IQ4_XS => q(QType::IQ4_XS),
        GgmlType::IQ1_M => q(QType::IQ1_M),
        GgmlType::TQ1_0 => q(QType::TQ1_0),
        GgmlType::TQ2_0 => q(QType::TQ2_0),
        GgmlType::Q8_1
        | GgmlType::Q8_K
        | GgmlType::I8
        | GgmlType::I16
        | GgmlType::I32
        | GgmlType::I64
        | GgmlType::F64
        | GgmlType::MXFP4
        | GgmlType::NVFP4
        | GgmlType::Q1_0 => None,
    }
}

/// The GGUF types graft reads as weights, comma-separated (for errors).
fn weight_type_names() -> String {
    let names: Vec<&str> = GgmlType::ALL
        .into_iter()
        .filter(|&t| weight_dtype(t).is_some())
        .map(GgmlType::name)
        .collect();
    names.join(", ")
}

/// The GGUF type of a graft weight dtype.
pub fn ggml_type(d: DType) -> Option<GgmlType> {
    let id = match d {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::BF16 => 30,
        DType::I32 => return None,
        DType::Quant(q) => q.ggml_type_id(),
    };
    GgmlType::from_id(id)
}

/// Typed access to the keys of one file, errors prefixed with the file.
struct Keys<'a> {
    f: &'a GgufFile,
}

impl Keys<'_> {
    fn err(&self, e: Error) -> Error {
        Error::model(format!("{}: {e}", self.f.path()))
    }

    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.f.metadata().get_u64(key).map_err(|e| self.err(e))?;
        if v == 0 {
            return Err(self.err(Error::model(format!("metadata key '{key}' is 0"))));
        }
        usize::try_from(v).map_err(|_| self.err(Error::model(format!("'{key}' {v} is too large"))))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.f.metadata().contains_key(key) {
            true => self.usize(key).map(Some),
            false => Ok(None),
        }
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.f.metadata().contains_key(key) {
            true => self
                .f
                .metadata()
                .get_f64(key)
                .map(|v| Some(v as f32))
                .map_err(|e| self.err(e)),
            false => Ok(None),
        }
    }

    fn opt_u32(&self, key: &str) -> Result<Option<u32>> {
        match self.f.metadata().contains_key(key) {
            true => self
                .f
                .metadata()
                .get_u32(key)
                .map(Some)
                .map_err(|e| self.err(e)),
            false => Ok(None),
        }
    }
}

/// The hyper-parameters of a GGUF file of a supported architecture (see [`Arch`]):
/// `{arch}.*` keys, llama.cpp's names. A `llama` file with
/// `llama.attention.sliding_window` is a Mistral model.
pub fn config_from_gguf(f: &GgufFile) -> Result<Config> {
    let k = Keys { f };
    let bad = |msg: String| Error::model(format!("{}: {msg}", f.path()));
    let name = f
        .metadata()
        .get_str("general.architecture")
        .map_err(|e| k.err(e))?;
    let mut arch = Arch::from_gguf(name).ok_or_else(|| {
        bad(format!(
            "metadata key 'general.architecture' is '{name}'; graft runs llama, qwen2, qwen3, qwen3moe and gpt2 files (Mistral and Mixtral are written as llama)"
        ))
    })?;
    let key = |s: &str| format!("{name}.{s}");
    let sliding_window = k.opt_usize(&key("attention.sliding_window"))?;
    let n_expert = k.opt_usize(&key("expert_count"))?.unwrap_or(0);
    if n_expert > 0 && arch == Arch::Llama {
        arch = Arch::Mixtral;
    } else if sliding_window.is_some() && arch == Arch::Llama {
        arch = Arch::Mistral;
    }
    let moe = moe(&k, f, name, arch, n_expert)?;
    let hidden_size = k.usize(&key("embedding_length"))?;
    let n_head = k.usize(&key("attention.head_count"))?;
    let n_kv_head = k
        .opt_usize(&key("attention.head_count_kv"))?
        .unwrap_or(n_head);
    let head_dim = head_dim(&k, name, hidden_size, n_head)?;
    if n_head % n_kv_head != 0 || head_dim % 2 != 0 {
        return Err(bad(format!("metadata keys '{name}.attention.head_count_kv' {n_kv_head} must divide '{name}.attention.head_count' {n_head}, and the head size {head_dim} must be even")));
    }
    let eps_key = match arch.spec().norm {
        NormKind::Rms => key("attention.layer_norm_rms_epsilon"),
        NormKind::Layer => key("attention.layer_norm_epsilon"),
    };
    let norm_eps = k
        .opt_f32(&eps_key)?
        .ok_or_else(|| bad(format!("metadata key '{eps_key}' is missing")))?;
    if !(norm_eps.is_finite() && norm_eps > 0.0) {
        return Err(bad(format!(
            "metadata key '{eps_key}' {norm_eps} must be > 0"
        )));
    }
    let vocab_size = vocab_size(f, &k, &key("vocab_size"))?;
    let in_vocab = |key: &str, id: Option<u32>| {
        id.filter(|&id| {
            let ok = (id as usize) < vocab_size;
            if !ok {
                warn_bad_special_token(key, id, vocab_size);
            }
            ok
        })
    };
    let bos_key = "tokenizer.ggml.bos_token_id";
    let bos = in_vocab(bos_key, k.opt_u32(bos_key)?);
    let mut eos_token_ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = in_vocab(key, k.opt_u32(key)?) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    let mut cfg = Config {
        arch,
        hidden_size,
        intermediate_size: k.usize(&key(arch
            .spec()
            .experts
            .map_or("feed_forward_length", |e| e.gguf_ff)))?,
        num_hidden_layers: k.usize(&key("block_count"))?,
        num_attention_heads: n_head,
        num_key_value_heads: n_kv_head,
        head_dim,
        norm_eps,
        vocab_size,
        max_position_embeddings: k.usize(&key("context_length"))?,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        bos_token_id: bos,
        eos_token_ids,
        dtype: None,
        rope_theta: k
            .opt_f32(&key("rope.freq_base"))?
            .unwrap_or(DEFAULT_ROPE_THETA),
        rope_scaling: None,
        sliding_window,
        moe,
        tp: 1,
    };
    cfg.rope_scaling = llama3_scaling(f, &k, &cfg)?;
    Ok(cfg)
}

/// Warns (once) that the special-token id of metadata key `key` is outside the
/// vocabulary of `n` tokens and is not used, as llama.cpp does ("bad special token"):
/// without an EOS id, generation runs to its `-n` tokens (or a chat template's end of
/// turn). The config and the tokenizer of one file give the same warning.
pub fn warn_bad_special_token(key: &str, id: u32, n: usize) {
    crate::error::warn_once(&format!(
        "metadata key '{key}': token id {id} is outside the vocabulary of {n} tokens; it is not used"
    ));
}

/// The mixture of experts of a file of an architecture with experts: `{arch}.expert_count`
/// and `expert_used_count`, the gating of `expert_gating_func` (llama.cpp's 1 softmax, 2
/// sigmoid; softmax when absent), renormalised unless `expert_weights_norm` is false
/// (llama.cpp renormalises Qwen3-MoE and Mixtral).
fn moe(k: &Keys, f: &GgufFile, name: &str, arch: Arch, n_expert: usize) -> Result<Option<Moe>> {
    if arch.spec().experts.is_none() {
        return Ok(None);
    }
    let key = |s: &str| format!("{name}.{s}");
    let gating = match k.opt_u32(&key("expert_gating_func"))? {
        None | Some(1) => Gating::Softmax,
        Some(2) => Gating::Sigmoid,
        Some(g) => {
            return Err(Error::model(format!(
                "{}: metadata key '{}' is {g}; graft runs 1 (softmax) and 2 (sigmoid)",
                f.path(),
                key("expert_gating_func")
            )))
        }
    };
    let norm_key = key("expert_weights_norm");
    let norm_topk = match f.metadata().contains_key(&norm_key) {
        true => f.metadata().get_bool(&norm_key).map_err(|e| k.err(e))?,
        false => true,
    };
    let moe = Moe {
        n_expert,
        n_used: k.usize(&key("expert_used_count"))?,
        gating,
        norm_topk,
    };
    let fields = [key("expert_count"), key("expert_used_count")];
    moe.check(f.path(), [&fields[0], &fields[1]])?;
    Ok(Some(moe))
}

/// The head size: `{arch}.attention.key_length` (Qwen3's explicit head size), else
/// `{arch}.rope.dimension_count`, else hidden / heads; the rotated part must be the
/// whole head.
fn head_dim(k: &Keys, name: &str, hidden: usize, n_head: usize) -> Result<usize> {
    let bad = |msg: String| Error::model(format!("{}: {msg}", k.f.path()));
    let key_len = k.opt_usize(&format!("{name}.attention.key_length"))?;
    let rot = k.opt_usize(&format!("{name}.rope.dimension_count"))?;
    let head_dim = match (key_len, rot) {
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) if hidden.is_multiple_of(n_head) => hidden / n_head,
        (None, None) => return Err(bad(format!("metadata keys '{name}.attention.key_length' and '{name}.rope.dimension_count' are missing and {name}.embedding_length {hidden} is not a multiple of {name}.attention.head_count {n_head}"))),
    };
    if let Some(r) = rot.filter(|&r| r != head_dim) {
        return Err(bad(format!("metadata key '{name}.rope.dimension_count' {r} differs from the head size {head_dim} (partial rope is not supported)")));
    }
    Ok(head_dim)
}

/// `{arch}.vocab_size` (`key`), else the length of `tokenizer.ggml.tokens`, else the
/// rows of `token_embd.weight`.
fn vocab_size(f: &GgufFile, k: &Keys, key: &str) -> Result<usize> {
    if let Some(v) = k.opt_usize(key)? {
        return Ok(v);
    }
    if let Some(crate::gguf::Value::Array(a)) = f.metadata().get("tokenizer.ggml.tokens") {
        if !a.is_empty() {
            return Ok(a.len());
        }
    }
    match f.tensor("token_embd.weight").map(|t| t.dims.as_slice()) {
        Some([_, rows]) => Ok(*rows as usize),
        Some(_) | None => Err(Error::model(format!(
            "{}: no vocabulary size: '{key}', 'tokenizer.ggml.tokens' and a 2-d 'token_embd.weight' are all missing",
            f.path()
        ))),
    }
}

/// The Llama 3 rope scaling of the file, if it has `rope_freqs.weight` (see the module
/// docs).
fn llama3_scaling(f: &GgufFile, k: &Keys, cfg: &Config) -> Result<Option<Llama3Scaling>> {
    let Some(info) = f.tensor(ROPE_FREQS) else {
        return Ok(None);
    };
    let bad = |msg: String| Error::model(format!("{}: tensor '{ROPE_FREQS}' {msg}", f.path()));
    let pairs = cfg.head_dim / 2;
    if info.ty != GgmlType::F32 || info.dims != [pairs as u64] {
        return Err(bad(format!(
            "is {} {:?}, expected F32 [{pairs}]",
            info.ty, info.dims
        )));
    }
    let divisors: Vec<f32> = f
        .tensor_bytes(ROPE_FREQS)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let given = match k.opt_f32(llama3_keys::FACTOR)? {
        Some(factor) => Some(Llama3Scaling {
            factor,
            low_freq_factor: k.opt_f32(llama3_keys::LOW)?.unwrap_or(1.0),
            high_freq_factor: k.opt_f32(llama3_keys::HIGH)?.unwrap_or(4.0),
            original_max_position: k.opt_usize(llama3_keys::ORIGINAL)?.unwrap_or(8192),
        }),
        None => None,
    };
    let fitted = Llama3Scaling {
        factor: divisors.iter().copied().fold(1.0, f32::max),
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };
    let s = given.unwrap_or(fitted);
    let want = rope_freq_divisors(cfg, s);
    let worst = want
        .iter()
        .zip(&divisors)
        .map(|(a, b)| ((a - b) / a).abs())
        .fold(0.0, f32::max);
    if worst > 1e-3 {
        return Err(bad(format!(
            "does not match Llama 3 rope scaling {s:?} (relative difference {worst:.1e}); set the {} keys",
            "graft.rope.llama3.*"
        )));
    }
    Ok(Some(s))
}

/// llama.cpp's `rope_freqs` for Llama 3 scaling `s`: the divisor of each pair's
/// frequency (1 for high frequencies, `factor` for low ones).
pub fn rope_freq_divisors(cfg: &Config, s: Llama3Scaling) -> Vec<f32> {
    let plain = RopeParams::new(RopeMode::Neox, cfg.head_dim, cfg.rope_theta);
    let scaled = RopeParams {
        llama3: Some(s),
        ..plain
    };
    (0..cfg.head_dim / 2)
        .map(|i| plain.inv_freq(i) / scaled.inv_freq(i))
        .collect()
}

/// One tensor found in the file.
struct Found<'a> {
    bytes: Cow<'a, [u8]>,
    dtype: DType,
}

/// Checks every tensor of the model in `f` against `cfg`: present, of a supported type,
/// with the expected `ne`; and no tensor left over.
fn find_tensors<'a>(
    f: &'a GgufFile,
    cfg: &Config,
) -> Result<HashMap<(Role, Option<usize>), Found<'a>>> {
    let spec = cfg.arch.spec();
    let bad =
        |name: &str, msg: String| Error::model(format!("{}: tensor '{name}' {msg}", f.path()));
    let layers = layers_named(f.tensors().iter().map(|t| t.name.as_str()), "blk.");
    let ne_of = |role: Role| {
        let name = spec.gguf_source(role, Some(0)).name;
        let info = f
            .tensor(&name)
            .ok_or_else(|| bad(&name, "is missing".into()))?;
        let ne = info
            .dims
            .iter()
            .map(|&d| usize::try_from(d).unwrap_or(usize::MAX));
        Ok((format!("tensor '{name}'"), ne.collect()))
    };
    check_sizes(cfg, &SizeFields::gguf(cfg), f.path(), layers, &ne_of)?;
    let probe = Weights::layout(cfg, &uniform(DType::F32), BufferId(0));
    let mut found = HashMap::new();
    let mut names = vec![ROPE_FREQS.to_string()];
    for slot in probe.slots(cfg) {
        let src = spec.gguf_source(slot.role, slot.layer);
        let name = src.name.as_str();
        let mut want = source_shape(&slot.shape, &src);
        want.reverse();
        let info = f
            .tensor(name)
            .ok_or_else(|| bad(name, format!("is missing (expected ne {want:?})")))?;
        let dtype = weight_dtype(info.ty).ok_or_else(|| {
            bad(
                name,
                format!(
                    "has type {}, which graft does not support ({})",
                    info.ty,
                    weight_type_names()
                ),
            )
        })?;
        let got: Vec<usize> = info.dims.iter().map(|&d| d as usize).collect();
        if got != want {
            return Err(bad(name, format!("has ne {got:?}, expected {want:?}")));
        }
        let bytes = source_bytes(f.tensor_bytes(name)?, dtype, &slot.shape, &src)?;
        found.insert((slot.role, slot.layer), Found { bytes, dtype });
        names.push(src.name);
    }
    if let Some(extra) = f.tensors().iter().find(|t| !names.contains(&t.name)) {
        return Err(bad(
            &extra.name,
            format!(
                "is not part of a {} model with {} layers",
                cfg.arch, cfg.num_hidden_layers
            ),
        ));
    }
    Ok(found)
}

/// The heads of `role` whose rows llama.cpp's converter permuted for its rope (q and
/// k of architectures that use its interleaved rope), if any.
pub(crate) fn permuted_heads(cfg: &Config, role: Role) -> Option<usize> {
    if !cfg.arch.spec().gguf_rope_permuted {
        return None;
    }
    match (role.qkv_part(), role.is_vector()) {
        (Some(0), false) => Some(cfg.num_attention_heads),
        (Some(1), false) => Some(cfg.num_key_value_heads),
        (Some(_), _) | (None, _) => None,
    }
}

/// Loads the weights of GGUF file `f` (hyper-parameters `cfg`) into a new buffer on
/// `be`: Q and K rows un-permuted to the HF rope layout where llama.cpp permutes them,
/// vectors converted to F32, the matrices converted as `opts.quantize` says or kept in
/// their type.
pub fn load_gguf_weights(
    f: &GgufFile,
    cfg: &Config,
    be: &mut dyn Backend,
    opts: &LoadOptions,
) -> Result<Weights> {
    let found = find_tensors(f, cfg)?;
    let split = Split::new(cfg, be.devices())?;
    let shard = split.shard();
    let target = |role: Role, layer: Option<usize>| match (role.is_vector(), opts.quantize) {
        (true, _) => DType::F32,
        (false, Some(plan)) => plan.pick(role, layer, &shard).dtype,
        (false, None) => found.get(&(role, layer)).map_or(DType::F32, |s| s.dtype),
    };
    if let (Some(plan), true) = (opts.quantize, opts.progress) {
        for line in fallback_notes(plan, &shard) {
            eprintln!("{line}");
        }
    }
    let weights = Weights::alloc(&shard, &target, be)?;
    for slot in weights.slots(&shard) {
        let src = &found[&(slot.role, slot.layer)];
        match permuted_heads(cfg, slot.role) {
            Some(n) => {
                let row = src.dtype.row_bytes(slot.role.row_len(cfg));
                let hf = permute_rope_rows(&src.bytes, n, row, false);
                upload(be, &split, &weights, &slot, &hf, src.dtype)?;
            }
            None => upload(be, &split, &weights, &slot, &src.bytes, src.dtype)?,
        }
    }
    Ok(weights)
}

/// Opens the GGUF model file `path`. A file that is not GGUF but lies in a Hugging Face
/// model folder (next to a `config.json`: the config itself, a safetensors file, the
/// tokenizer) is an error saying to pass the folder.
pub fn open_model_file(path: &Path) -> Result<GgufFile> {
    GgufFile::open(path).map_err(|e| {
        let dir = path.parent().filter(|d| d.join("config.json").is_file());
        match (&e, dir) {
            (Error::Gguf { field, .. }, Some(dir)) if field == "header magic" => {
                Error::model(format!(
                    "{} is not a GGUF file but a file of the Hugging Face model folder {}: pass the folder (--model {})",
                    path.display(),
                    dir.display(),
                    dir.display()
                ))
            }
            (_, _) => e,
        }
    })
}

/// Whether `path` names a GGUF file rather than a model folder.
/// Anything that exists and is not a folder counts as a file, so that a FIFO or a device
/// gets the reader's "not a regular file" error rather than "does not exist".
pub fn is_gguf_path(path: &Path) -> bool {
    path.exists() && !path.is_dir()
}
