//! Writing a Hugging Face folder as a GGUF file that llama.cpp reads (`graft convert`):
//! llama.cpp's architecture name and metadata keys (`general.*`, `{arch}.*`,
//! `tokenizer.ggml.*`), its tensor names (GPT-2's q, k and v fused into `attn_qkv`), Q
//! and K rows permuted to its rope layout where its `llama` architecture wants them,
//! the experts of a mixture of experts stacked into `ffn_{gate,up,down}_exps` with
//! llama.cpp's `expert_*` keys, each matrix converted as
//! a [`QuantPlan`] says (norms F32), data aligned to 32 bytes, written through
//! [`write_output`](crate::gguf::write_output) (a temporary file renamed into place).
//!
//! The tokenizer comes from the folder's `tokenizer.json`, converted by
//! [`TokenizerSpec::from_hf_tokenizer_json`]. Llama 3 rope scaling is written as
//! llama.cpp's `rope_freqs.weight` tensor and, for graft, as the `graft.rope.llama3.*`
//! keys (see [`gguf_model`](crate::models::load::gguf)).

use std::borrow::Cow;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::{Array, GgmlType, GgufWriter, Metadata, Value};
use crate::graph::BufferId;

use crate::models::arch::config::{Config, Gating};
use crate::models::arch::{NormKind, Positions};
use crate::models::load::gguf::{
    ggml_type, llama3_keys, permuted_heads, rope_freq_divisors, ROPE_FREQS,
};
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::rows::{convert_rows, permute_rope_rows};
use crate::models::load::safetensors::{fallback_notes, with_hf_tensors, Found};
use crate::models::load::weights::Weights;
use crate::models::text::gguf_tokenizer::TokenizerSpec;

/// ggml's quantization version (`GGML_QNT_VERSION`), written with quantized files.
const QNT_VERSION: u32 = 2;

/// What [`convert`] wrote.
#[derive(Clone, Debug)]
pub struct Converted {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of tensor data.
    pub data_bytes: usize,
    /// Notes on tensors that fell back to another type (one line each kind).
    pub notes: Vec<String>,
    /// Whether tokenizer metadata was written (the folder had a tokenizer.json).
    pub tokenizer: bool,
}

/// Converts the HF folder `dir` into the GGUF file `out`, matrices as `plan`
/// says; `name` is `general.name` (default: the folder's name).
pub fn convert(dir: &Path, plan: QuantPlan, out: &Path, name: Option<&str>) -> Result<Converted> {
    let cfg = Config::from_file(&dir.join("config.json"))?;
    let tok_path = dir.join("tokenizer.json");
    let spec = if tok_path.exists() {
        let text = crate::files::read_regular_to_string(&tok_path)?;
        Some(TokenizerSpec::from_hf_tokenizer_json(
            &text,
            &cfg.eos_token_ids,
        )?)
    } else {
        None
    };
    let default_name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name
        .map(str::to_string)
        .or(default_name)
        .unwrap_or_else(|| cfg.arch.name().into());
    let mut w = GgufWriter::new();
    w.set_alignment(32)?;
    model_metadata(w.metadata_mut(), &cfg, plan, &name);
    if let Some(spec) = &spec {
        tokenizer_metadata(w.metadata_mut(), spec);
    }
    let freqs: Option<Vec<u8>> = cfg.rope_scaling.map(|s| {
        rope_freq_divisors(&cfg, s)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    });
    if let Some(s) = cfg.rope_scaling {
        let m = w.metadata_mut();
        m.insert(llama3_keys::FACTOR, Value::F32(s.factor));
        m.insert(llama3_keys::LOW, Value::F32(s.low_freq_factor));
        m.insert(llama3_keys::HIGH, Value::F32(s.high_freq_factor));
        m.insert(
            llama3_keys::ORIGINAL,
            Value::U32(s.original_max_position as u32),
        );
    }
    with_hf_tensors(dir, &cfg, |found| {
        let tensors = converted_tensors(found, &cfg, plan)?;
        let (count, mut data_bytes) = (tensors.len(), 0);
        for (gguf_name, ne, ty, data) in tensors {
            data_bytes += data.len();
            w.add_tensor(&gguf_name, &ne, ty, Cow::Owned(data))?;
        }
        if let Some(f) = &freqs {
            let pairs = cfg.head_dim as u64 / 2;
            w.add_tensor(
                ROPE_FREQS,
                &[pairs],
                GgmlType::F32,
                Cow::Borrowed(f.as_slice()),
            )?;
        }
        w.write_file_guarded(out, &crate::models::load::safetensors::input_files(dir))?;
        Ok(Converted {
            tensors: count + usize::from(freqs.is_some()),
            data_bytes,
            notes: fallback_notes(plan, &cfg),
            tokenizer: spec.is_some(),
        })
    })
}

/// One tensor to write: GGUF name, `ne`, type and data.
type Tensor = (String, Vec<u64>, GgmlType, Vec<u8>);

/// Every tensor in its GGUF name, type and layout (Q/K rows permuted for ggml's rope
/// where llama.cpp does; the parts of a fused tensor such as GPT-2's `attn_qkv`
/// concatenated, in one type).
fn converted_tensors(found: &Found, cfg: &Config, plan: QuantPlan) -> Result<Vec<Tensor>> {
    let spec = cfg.arch.spec();
    let pick = |role, layer| plan.pick(role, layer, cfg).dtype;
    let layout = Weights::layout(cfg, &pick, BufferId(0));
    let mut out: Vec<Tensor> = Vec::new();
    for slot in layout.slots(cfg) {
        let (bytes, from) = &found[&(slot.role, slot.layer)];
        let to = slot.at.dtype;
        let src = spec.gguf_source(slot.role, slot.layer);
        let data = convert_rows(&src.name, bytes, *from, to, slot.row_len())?;
        let data = match permuted_heads(cfg, slot.role) {
            Some(n) => permute_rope_rows(&data, n, to.row_bytes(slot.row_len()), true),
            None => data,
        };
        let ty = ggml_type(to)
            .ok_or_else(|| Error::model(format!("tensor '{}': no GGUF type for {to}", src.name)))?;
        let ne: Vec<u64> = slot.role.ne(cfg).iter().map(|&d| d as u64).collect();
        match (src.rows, out.last_mut()) {
            (Some((i, _)), Some(last)) if i > 0 && last.0 == src.name => {
                if last.2 != ty {
                    return Err(Error::model(format!(
                        "tensor '{}': its parts have types {} and {ty}; a fused tensor needs one",
                        src.name, last.2
                    )));
                }
                // the outermost dimension grows by this part's
                if let (Some(total), Some(part)) = (last.1.last_mut(), ne.last()) {
                    *total += part;
                }
                last.3.extend_from_slice(&data);
            }
            // a whole tensor, or the first part of a fused one (the later parts grow it)
            (_, _) => out.push((src.name, ne, ty, data)),
        }
    }
    Ok(out)
}

/// The `general.*` and `{arch}.*` keys (llama.cpp's names).
fn model_metadata(m: &mut Metadata, cfg: &Config, plan: QuantPlan, name: &str) {
    let spec = cfg.arch.spec();
    let u = |v: usize| Value::U32(v as u32);
    let a = spec.gguf_arch;
    let key = |s: &str| format!("{a}.{s}");
    m.insert("general.architecture", Value::String(a.into()));
    m.insert("general.name", Value::String(name.into()));
    m.insert("general.file_type", Value::U32(plan.llama_ftype()));
    if plan.base().quant().is_some() {
        m.insert("general.quantization_version", Value::U32(QNT_VERSION));
    }
    m.insert(key("context_length"), u(cfg.max_position_embeddings));
    m.insert(key("embedding_length"), u(cfg.hidden_size));
    m.insert(key("block_count"), u(cfg.num_hidden_layers));
    match (cfg.moe, spec.experts) {
        (Some(moe), Some(keys)) => {
            // llama.cpp's names: Mixtral's expert width is its feed_forward_length
            m.insert(key(keys.gguf_ff), u(cfg.intermediate_size));
            m.insert(key("expert_count"), u(moe.n_expert));
            m.insert(key("expert_used_count"), u(moe.n_used));
            m.insert(key("expert_weights_norm"), Value::Bool(moe.norm_topk));
            let gating = match moe.gating {
                Gating::Softmax => 1,
                Gating::Sigmoid => 2,
            };
            m.insert(key("expert_gating_func"), Value::U32(gating));
        }
        (Some(_), None) | (None, _) => {
            m.insert(key("feed_forward_length"), u(cfg.intermediate_size))
        }
    }
    m.insert(key("attention.head_count"), u(cfg.num_attention_heads));
    m.insert(key("attention.head_count_kv"), u(cfg.num_key_value_heads));
    match spec.norm {
        NormKind::Rms => m.insert(
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.norm_eps),
        ),
        NormKind::Layer => m.insert(
            key("attention.layer_norm_epsilon"),
            Value::F32(cfg.norm_eps),
        ),
    }
    if spec.positions == Positions::Rope {
        m.insert(key("rope.dimension_count"), u(cfg.head_dim));
        m.insert(key("attention.key_length"), u(cfg.head_dim));
        m.insert(key("attention.value_length"), u(cfg.head_dim));
        m.insert(key("rope.freq_base"), Value::F32(cfg.rope_theta));
    }
    if let Some(w) = cfg.sliding_window {
        m.insert(key("attention.sliding_window"), u(w));
    }
    m.insert(key("vocab_size"), u(cfg.vocab_size));
}

/// The `tokenizer.ggml.*` keys of `spec`.
fn tokenizer_metadata(m: &mut Metadata, spec: &TokenizerSpec) {
    let t = "tokenizer.ggml";
    m.insert(format!("{t}.model"), Value::String(spec.model.clone()));
    if let Some(pre) = &spec.pre {
        m.insert(format!("{t}.pre"), Value::String(pre.clone()));
    }
    m.insert(
        format!("{t}.tokens"),
        Value::Array(Array::String(spec.tokens.clone())),
    );
    if let Some(s) = &spec.scores {
        m.insert(format!("{t}.scores"), Value::Array(Array::F32(s.clone())));
    }
    if let Some(tt) = &spec.token_types {
        m.insert(
            format!("{t}.token_type"),
            Value::Array(Array::I32(tt.clone())),
        );
    }
    if let Some(mg) = &spec.merges {
        m.insert(
            format!("{t}.merges"),
            Value::Array(Array::String(mg.clone())),
        );
    }
    let ids = [
        ("bos_token_id", spec.bos),
        ("eos_token_id", spec.eos),
        ("eot_token_id", spec.eot),
        ("eom_token_id", spec.eom),
        ("unknown_token_id", spec.unk),
        ("padding_token_id", spec.pad),
    ];
    for (key, id) in ids {
        if let Some(id) = id {
            m.insert(format!("{t}.{key}"), Value::U32(id));
        }
    }
    let flags = [
        ("add_bos_token", spec.add_bos),
        ("add_eos_token", spec.add_eos),
        ("add_space_prefix", spec.add_space_prefix),
    ];
    for (key, flag) in flags {
        if let Some(b) = flag {
            m.insert(format!("{t}.{key}"), Value::Bool(b));
        }
    }
    if let Some(tpl) = &spec.chat_template {
        m.insert("tokenizer.chat_template", Value::String(tpl.clone()));
    }
}
