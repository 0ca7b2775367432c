//! Loads a Hugging Face checkpoint's safetensors weights into one backend buffer.
//!
//! A folder holds either `model.safetensors` or `model.safetensors.index.json` whose
//! `weight_map` names the shard file of every tensor. Files are memory-mapped and each
//! tensor is uploaded with one `write_buffer` straight from the mapping, one tensor at a
//! time, so no second full copy of the model is ever made on the host.
//!
//! Everything is checked before the weight buffer is allocated: every expected tensor
//! is present with its expected shape and a supported dtype (F32, F16 or BF16, each
//! tensor its own), no tensor is left over (derived rope buffers `*.rotary_emb.inv_freq`
//! of old checkpoints are ignored), and every tensor's bytes lie inside its file. Errors
//! name the file, the tensor and what was expected.
//!
//! Norm weights are converted to F32. With a [`QuantPlan`] (`--quantize`), each matrix
//! is converted on the host to the plan's dtype while loading (rows in parallel), one
//! tensor at a time; otherwise matrices keep their dtype and are uploaded as they are.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::files::{join_inside, open_regular, read_regular_to_string};
use crate::graph::{BufferId, DType};

use crate::models::arch::config::Config;
use crate::models::arch::role::Role;
use crate::models::arch::tp::Split;
use crate::models::arch::Source;
use crate::models::load::options::LoadOptions;
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::rows::{convert_rows, source_bytes, source_shape};
use crate::models::load::weights::{check_sizes, layers_named, uniform, SizeFields, Slot, Weights};

/// File name of a Hugging Face tokenizer inside a model folder.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// File name of the Hugging Face tokenizer settings (chat template, BOS/EOS texts).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// The single-file checkpoint name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The sharded checkpoint index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The files a model at `path` is read from, for refusing to overwrite them: the file
/// itself for a GGUF file; for a folder, those of its config, checkpoint (every
/// `*.safetensors` file and the index) and tokenizer that exist.
pub fn input_files(path: &Path) -> Vec<PathBuf> {
    if !path.is_dir() {
        return vec![path.to_path_buf()];
    }
    let named = [
        "config.json",
        INDEX_FILE,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE,
    ];
    let mut files: Vec<PathBuf> = named.iter().map(|n| path.join(n)).collect();
    if let Ok(entries) = std::fs::read_dir(path) {
        files.extend(
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors")),
        );
    }
    files.retain(|p| p.exists());
    files
}

/// The bytes of a safetensors file: memory-mapped, or in memory (fuzzing).
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One safetensors file (memory-mapped).
struct Shard {
    path: PathBuf,
    map: Bytes,
    /// File offset of the data section (after the 8-byte length and the header).
    data_start: usize,
    meta: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        let file = open_regular(path)?;
        // SAFETY: the file is opened read-only and only read through the mapping; like
        // every memory-mapped reader we rely on no other process truncating or rewriting
        // the checkpoint while it is being loaded.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Shard::parse(path, Bytes::Map(map))
    }

    /// Reads the header of the safetensors bytes `map` (from `path`): its length checked
    /// against the bytes, then the JSON (every tensor's offsets checked by safetensors).
    fn parse(path: &Path, map: Bytes) -> Result<Shard> {
        let bad = |msg: String| Error::model(format!("{}: {msg}", path.display()));
        let len_bytes: [u8; 8] = map
            .get(..8)
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| {
                bad(format!(
                    "{} bytes is too short for a safetensors file",
                    map.len()
                ))
            })?;
        let n = u64::from_le_bytes(len_bytes);
        let data_start = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_add(8))
            .filter(|&end| end <= map.len())
            .ok_or_else(|| {
                bad(format!(
                    "the header claims {n} bytes but the file has {} (truncated?)",
                    map.len()
                ))
            })?;
        let header = &map[8..data_start];
        let meta: Metadata = serde_json::from_slice(header).map_err(|e| {
            let why = explain_header(header).unwrap_or_default();
            bad(format!("bad safetensors header: {e}{why}"))
        })?;
        Ok(Shard {
            path: path.to_path_buf(),
            map,
            data_start,
            meta,
        })
    }

    /// The bytes of a tensor, checked against the file's length.
    fn bytes(&self, name: &str, info: &TensorInfo) -> Result<&[u8]> {
        let (s, e) = info.data_offsets;
        let at = |o: usize| {
            self.data_start
                .checked_add(o)
                .filter(|&x| x <= self.map.len())
        };
        match (at(s), at(e)) {
            (Some(fs), Some(fe)) if fs <= fe => Ok(&self.map[fs..fe]),
            (Some(_) | None, Some(_) | None) => Err(Error::model(format!(
                "{} is truncated: tensor '{name}' needs data bytes {s}..{e} after the header ({} bytes), the file has {} bytes",
                self.path.display(),
                self.data_start,
                self.map.len()
            ))),
        }
    }
}

/// Why safetensors refused a `header`, naming the tensor (its message does not): a
/// missing or unknown dtype, a bad shape or offsets, data that does not match its shape,
/// or offsets that do not tile the data section. `None` when no such reason is found.
fn explain_header(header: &[u8]) -> Option<String> {
    let map: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    let mut spans = Vec::new();
    for (name, t) in map.iter().filter(|(n, _)| *n != "__metadata__") {
        let field = |key: &str| t.get(key).cloned().unwrap_or_default();
        let why = |msg: String| Some(format!(" (tensor '{name}': {msg})"));
        let Ok(dtype) = serde_json::from_value::<Dtype>(field("dtype")) else {
            return why(format!("unknown dtype {}", field("dtype")));
        };
        let Ok(shape) = serde_json::from_value::<Vec<usize>>(field("shape")) else {
            return why(format!("shape {} is not a list of sizes", field("shape")));
        };
        let Ok([start, end]) = serde_json::from_value::<[usize; 2]>(field("data_offsets")) else {
            return why(format!(
                "data_offsets {} is not [start, end]",
                field("data_offsets")
            ));
        };
        let bytes = shape
            .iter()
            .try_fold(dtype.bitsize(), |a, &d| a.checked_mul(d))
            .map(|bits| bits.div_ceil(8));
        if start > end || bytes != Some(end - start) {
            return why(format!(
                "shape {shape:?} of {dtype:?} does not match data_offsets [{start}, {end}]"
            ));
        }
        spans.push((start, end, name));
    }
    spans.sort();
    let mut at = 0;
    for (start, end, name) in spans {
        if start != at {
            return Some(format!(
                " (tensor '{name}': data_offsets start at {start}, expected {at}: the tensors must tile the data without gaps or overlaps)"
            ));
        }
        at = end;
    }
    None
}

/// A checkpoint's files and which one holds each tensor.
struct Checkpoint {
    shards: Vec<Shard>,
    /// Tensor name -> index into `shards` (sorted, so errors come out in a stable order).
    tensors: BTreeMap<String, usize>,
}

impl Checkpoint {
    fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        if index.exists() {
            Checkpoint::open_index(dir, &index)
        } else if single.exists() {
            let shard = Shard::open(&single)?;
            let tensors = shard.meta.tensors().into_keys().map(|n| (n, 0)).collect();
            Ok(Checkpoint {
                shards: vec![shard],
                tensors,
            })
        } else {
            Err(Error::model(format!(
                "{}: no {SINGLE_FILE} or {INDEX_FILE}",
                dir.display()
            )))
        }
    }

    fn open_index(dir: &Path, index: &Path) -> Result<Checkpoint> {
        let text = read_regular_to_string(index)?;
        let bad = |msg: String| Error::model(format!("{}: {msg}", index.display()));
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("field 'weight_map' is missing or not an object".into()))?;
        let mut shards: Vec<Shard> = Vec::new();
        let mut by_file: HashMap<String, usize> = HashMap::new();
        let mut tensors = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                bad(format!(
                    "field 'weight_map.{name}' must be a file name, found {file}"
                ))
            })?;
            let i = match by_file.get(file) {
                Some(&i) => i,
                None => {
                    let what = format!("weight_map entry '{name}'");
                    shards.push(Shard::open(&join_inside(dir, file, &what)?)?);
                    by_file.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            if shards[i].meta.info(name).is_none() {
                return Err(bad(format!(
                    "maps tensor '{name}' to {file}, which has no such tensor"
                )));
            }
            tensors.insert(name.clone(), i);
        }
        // Tensors in a shard but not in the map are still part of the checkpoint.
        for (i, s) in shards.iter().enumerate() {
            for name in s.meta.tensors().into_keys() {
                tensors.entry(name).or_insert(i);
            }
        }
        Ok(Checkpoint { shards, tensors })
    }

    /// Checks `cfg`'s sizes against the tensors present (see [`check_sizes`]) before
    /// anything is laid out from them.
    fn check_sizes(&self, dir: &Path, cfg: &Config) -> Result<()> {
        let spec = cfg.arch.spec();
        let prefix = spec.hf_layer_prefix();
        let short = prefix
            .strip_prefix(spec.hf_optional_prefix)
            .unwrap_or(&prefix);
        let names = || self.tensors.keys().map(String::as_str);
        let layers = layers_named(names(), &prefix).max(layers_named(names(), short));
        let ne_of = |role: Role| {
            let src = (spec.hf_source)(role, Some(0));
            let (name, shard, info) = self.find(&src.name, cfg).ok_or_else(|| {
                Error::model(format!(
                    "{}: tensor '{}' is missing",
                    dir.display(),
                    src.name
                ))
            })?;
            shard.bytes(name, info)?;
            let label = format!("{}: tensor '{name}'", shard.path.display());
            let mut ne = info.shape.clone();
            if !src.transposed {
                ne.reverse();
            }
            Ok((label, ne))
        };
        let source = dir.join("config.json").display().to_string();
        check_sizes(cfg, &SizeFields::hf(cfg), &source, layers, &ne_of)
    }

    /// The weight `src` of `shape` (outermost first, graft's layout): its bytes, dtype
    /// and name in the checkpoint, checked to be present with that shape, a supported
    /// dtype, and inside its file.
    fn tensor<'s>(
        &'s self,
        dir: &Path,
        cfg: &Config,
        shape: &[usize],
        src: &Source,
    ) -> Result<(Cow<'s, [u8]>, DType, String)> {
        let want = source_shape(shape, src);
        let (name, shard, info) = self.find(&src.name, cfg).ok_or_else(|| {
            Error::model(format!(
                "{}: tensor '{}' is missing (expected shape {want:?})",
                dir.display(),
                src.name,
            ))
        })?;
        let here = || format!("{}: tensor '{name}'", shard.path.display());
        let dtype = weight_dtype(info.dtype).ok_or_else(|| {
            Error::model(format!(
                "{} has dtype {:?}; supported: F32, F16, BF16",
                here(),
                info.dtype
            ))
        })?;
        if info.shape != want {
            return Err(Error::model(format!(
                "{} has shape {:?}, expected {want:?}",
                here(),
                info.shape,
            )));
        }
        let bytes = source_bytes(shard.bytes(name, info)?, dtype, shape, src)?;
        Ok((bytes, dtype, name.to_string()))
    }

    /// The experts' stack of `slot` (`[n_expert, rows, row]`) from the checkpoint's one
    /// tensor per expert (`src.name` with `{e}` the expert), which must share a dtype;
    /// their names are added to `used`. The stack is a copy: HF files keep each
    /// expert's matrix apart, the weight buffer holds them as one tensor.
    fn experts(
        &self,
        dir: &Path,
        cfg: &Config,
        slot: &Slot,
        src: &Source,
        used: &mut Vec<String>,
    ) -> Result<(Cow<'static, [u8]>, DType)> {
        let mut stack = Vec::new();
        let mut first = None;
        for e in 0..slot.shape[0] {
            let one = Source::whole(src.name.replace("{e}", &e.to_string()));
            let (bytes, dtype, name) = self.tensor(dir, cfg, &slot.shape[1..], &one)?;
            match first {
                None => first = Some((dtype, name.clone())),
                Some((d, ref n)) if d != dtype => {
                    return Err(Error::model(format!(
                        "{}: tensor '{name}' has dtype {dtype} but '{n}' has {d}: the experts of a block need one dtype",
                        dir.display()
                    )))
                }
                Some(_) => {}
            }
            stack.extend_from_slice(&bytes);
            used.push(name);
        }
        let dtype = first.map_or(DType::F32, |f| f.0);
        Ok((Cow::Owned(stack), dtype))
    }

    /// The tensor `name`, or `name` without the architecture's optional prefix: its
    /// name in the checkpoint, shard and info.
    fn find<'s>(
        &'s self,
        name: &str,
        cfg: &Config,
    ) -> Option<(&'s str, &'s Shard, &'s TensorInfo)> {
        let short = name.strip_prefix(cfg.arch.spec().hf_optional_prefix);
        [Some(name), short].into_iter().flatten().find_map(|n| {
            let (key, &i) = self.tensors.get_key_value(n)?;
            let s = &self.shards[i];
            s.meta.info(n).map(|info| (key.as_str(), s, info))
        })
    }
}

/// graft's dtype for a safetensors dtype, if supported for weights.
#[allow(clippy::wildcard_enum_match_arm)] // safetensors' own dtype list: the rest is unsupported
fn weight_dtype(d: Dtype) -> Option<DType> {
    match d {
        Dtype::F32 => Some(DType::F32),
        Dtype::F16 => Some(DType::F16),
        Dtype::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// A model's tensors by role and layer: bytes (in graft's `[out, in]` layout, a part of a
/// fused file tensor cut out) and dtype.
pub(crate) type Found<'a> = HashMap<(Role, Option<usize>), (Cow<'a, [u8]>, DType)>;

/// The tensors of the checkpoint in `dir` for `cfg` (each checked: present, supported
/// dtype, expected shape, inside its file; no tensor left over), by role and layer,
/// handed to `f` while the files are mapped.
pub(crate) fn with_hf_tensors<T>(
    dir: &Path,
    cfg: &Config,
    f: impl FnOnce(&Found) -> Result<T>,
) -> Result<T> {
    Checkpoint::open(dir)?.with_tensors(dir, cfg, f)
}

/// Loads the weights of one safetensors file held in memory (`bytes`, named `name` in
/// errors) for `cfg`, with every check of [`load_weights`]: the fuzzing entry point of
/// the safetensors header and config pairing.
pub fn load_weights_from_bytes(
    name: &str,
    bytes: Vec<u8>,
    cfg: &Config,
    be: &mut dyn Backend,
    opts: &LoadOptions,
) -> Result<Weights> {
    let shard = Shard::parse(Path::new(name), Bytes::Owned(bytes))?;
    let tensors = shard.meta.tensors().into_keys().map(|n| (n, 0)).collect();
    let ckpt = Checkpoint {
        shards: vec![shard],
        tensors,
    };
    ckpt.with_tensors(Path::new(name), cfg, |found| {
        upload_all(found, cfg, be, opts)
    })
}

impl Checkpoint {
    /// The tensors of this checkpoint (from `dir`) for `cfg`: see [`with_hf_tensors`].
    fn with_tensors<T>(
        &self,
        dir: &Path,
        cfg: &Config,
        f: impl FnOnce(&Found) -> Result<T>,
    ) -> Result<T> {
        self.check_sizes(dir, cfg)?;
        let probe = Weights::layout(cfg, &uniform(DType::F32), BufferId(0));
        let mut found = HashMap::new();
        let mut used = Vec::new();
        for slot in probe.slots(cfg) {
            let src = (cfg.arch.spec().hf_source)(slot.role, slot.layer);
            let (bytes, dtype) = match slot.role.is_experts() {
                true => self.experts(dir, cfg, &slot, &src, &mut used)?,
                false => {
                    let (bytes, dtype, name) = self.tensor(dir, cfg, &slot.shape, &src)?;
                    used.push(name);
                    (bytes, dtype)
                }
            };
            found.insert((slot.role, slot.layer), (bytes, dtype));
        }
        check_leftovers(self, &used, cfg)?;
        f(&found)
    }
}

/// Loads the weights of the checkpoint in `dir` for `cfg` into a new buffer on `be`,
/// converted as `opts.quantize` says (norms always to F32).
pub fn load_weights(
    dir: &Path,
    cfg: &Config,
    be: &mut dyn Backend,
    opts: &LoadOptions,
) -> Result<Weights> {
    with_hf_tensors(dir, cfg, |found| upload_all(found, cfg, be, opts))
}

/// Uploads every found tensor into a new weight buffer (see [`load_weights`]).
fn upload_all(
    found: &Found,
    cfg: &Config,
    be: &mut dyn Backend,
    opts: &LoadOptions,
) -> Result<Weights> {
    let split = Split::new(cfg, be.devices())?;
    let shard = split.shard();
    let target = |role: Role, layer: Option<usize>| match (role.is_vector(), opts.quantize) {
        (true, _) => DType::F32,
        (false, Some(plan)) => plan.pick(role, layer, &shard).dtype,
        (false, None) => found.get(&(role, layer)).map_or(DType::F32, |s| s.1),
    };
    let layout = Weights::layout(&shard, &target, BufferId(0));
    if let (Some(plan), true) = (opts.quantize, opts.progress) {
        for line in fallback_notes(plan, &shard) {
            eprintln!("{line}");
        }
    }
    let weights = Weights::alloc(&shard, &target, be)?;
    let bar = progress_bar(layout.bytes as u64, opts.progress);
    for slot in weights.slots(&shard) {
        let (bytes, dtype) = &found[&(slot.role, slot.layer)];
        upload(be, &split, &weights, &slot, bytes, *dtype)?;
        bar.inc(slot.bytes() as u64);
    }
    bar.finish_and_clear();
    Ok(weights)
}

/// Writes one tensor's bytes (of `from`, the whole tensor) into its slot (of one
/// device's share, `split`'s shard), converting on the host when the slot's dtype
/// differs: the whole tensor on one device, or each device's part of it
/// ([`Split::slice`]) on each member of a device group.
pub(crate) fn upload(
    be: &mut dyn Backend,
    split: &Split,
    weights: &Weights,
    slot: &Slot,
    bytes: &[u8],
    from: DType,
) -> Result<()> {
    for d in 0..split.n {
        let part = split.slice(&slot.name, slot.role, d, bytes, from)?;
        let data = match from == slot.at.dtype {
            true => part,
            false => convert_rows(&slot.name, &part, from, slot.at.dtype, slot.row_len())?.into(),
        };
        if data.len() != slot.bytes() {
            return Err(Error::model(format!(
                "internal: {} holds {} bytes for a slot of {}",
                slot.name,
                data.len(),
                slot.bytes()
            )));
        }
        match split.n {
            1 => be.write_buffer(weights.buffer, slot.at.offset, &data)?,
            _ => be.write_buffer_on(d, weights.buffer, slot.at.offset, &data)?,
        }
    }
    Ok(())
}

/// One line per kind of fallback a plan makes for `cfg` (rows that do not fit the
/// wanted type's block): which tensors, which type instead of which.
pub fn fallback_notes(plan: QuantPlan, cfg: &Config) -> Vec<String> {
    let probe = Weights::layout(cfg, &uniform(DType::F32), BufferId(0));
    let mut groups: BTreeMap<(String, String), (usize, Vec<usize>, String)> = BTreeMap::new();
    for s in probe.slots(cfg) {
        let pick = plan.pick(s.role, s.layer, cfg);
        if let Some(wanted) = pick.fallback_from {
            let e = groups
                .entry((wanted.to_string(), pick.dtype.to_string()))
                .or_insert((0, Vec::new(), s.gguf_name()));
            e.0 += 1;
            if !e.1.contains(&s.row_len()) {
                e.1.push(s.row_len());
            }
        }
    }
    groups
        .into_iter()
        .map(|((wanted, got), (n, rows, first))| {
            let block = DType::parse(&wanted).map_or(0, DType::block_size);
            format!(
                "quantize {plan}: {n} matrices (first {first}) have rows of {rows:?} elements, not a multiple of {wanted}'s block of {block}: using {got} instead"
            )
        })
        .collect()
}

/// Fails on a checkpoint tensor that is not part of the model (`used`): derived
/// buffers the architecture lists (`*.rotary_emb.inv_freq` of old Llama checkpoints,
/// GPT-2's causal-mask `attn.bias`) are ignored.
fn check_leftovers(ckpt: &Checkpoint, used: &[String], cfg: &Config) -> Result<()> {
    let spec = cfg.arch.spec();
    let expected: HashMap<&str, ()> = used.iter().map(|s| (s.as_str(), ())).collect();
    if let Some((name, &i)) = ckpt.tensors.iter().find(|(name, _)| {
        !expected.contains_key(name.as_str())
            && !spec.hf_ignored_suffixes.iter().any(|s| name.ends_with(s))
    }) {
        let hint = if name.ends_with("lm_head.weight") && cfg.tie_word_embeddings {
            " (config.json has tie_word_embeddings = true)"
        } else {
            ""
        };
        return Err(Error::model(format!(
            "{}: unexpected tensor '{name}' for a {} model with {} layers{hint}",
            ckpt.shards[i].path.display(),
            cfg.arch,
            cfg.num_hidden_layers
        )));
    }
    Ok(())
}

/// A byte progress bar on stderr, hidden unless wanted and stderr is a terminal.
fn progress_bar(total: u64, wanted: bool) -> ProgressBar {
    if !wanted || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "loading weights {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
    ) {
        bar.set_style(style);
    }
    bar
}
