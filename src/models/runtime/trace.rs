//! Traces of a forward pass (`graft trace`): every named intermediate of
//! [`TRACE_NAMES`](crate::models::blocks::TRACE_NAMES), read and written as safetensors files,
//! and compared tensor by tensor to find the first one where two runs part ways.
//!
//! A trace file holds one F32 tensor per name (its shape, tokens first) and three
//! metadata keys, the same ones `scripts/hf-trace.py` writes from HF transformers:
//! [`ORDER_KEY`] (the names in execution order, comma-separated), [`SOURCE_KEY`] (what
//! made it) and [`TOKENS_KEY`] (the token ids, comma-separated).
//!
//! Two traces are compared by walking one of them (`ours`) in execution order: each name
//! the other (the reference) also has is compared by NMSE = sum((a-b)^2) / sum(b^2), `b`
//! the reference, and by the largest absolute difference. The first tensor whose NMSE
//! exceeds the threshold (or is not finite, or whose shape differs) is the divergence;
//! everything after it inherits the error, so it is where to look.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Metadata, SafeTensors};
use safetensors::Dtype;

use crate::error::{Error, Result};

use crate::models::runtime::model::TraceTensor;

/// Metadata key: the tensor names in execution order, comma-separated.
pub const ORDER_KEY: &str = "graft.trace.order";
/// Metadata key: what produced the trace (`graft <model> <backend>`, `hf-trace.py <dir>`).
pub const SOURCE_KEY: &str = "graft.trace.source";
/// Metadata key: the token ids traced, comma-separated.
pub const TOKENS_KEY: &str = "graft.trace.tokens";

/// A whole trace: the tensors in execution order, the tokens and what produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The tensors, in execution order.
    pub tensors: Vec<TraceTensor>,
    /// The token ids the forward pass ran over.
    pub tokens: Vec<u32>,
    /// What produced it ([`SOURCE_KEY`]).
    pub source: String,
}

impl Trace {
    /// The trace as a safetensors file: F32 tensors in execution order and the three
    /// metadata keys. The same trace always gives the same bytes (the header's keys are
    /// written in a fixed order).
    pub fn to_safetensors(&self) -> Result<Vec<u8>> {
        let mut header = serde_json::Map::new();
        let order: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        let tokens: Vec<String> = self.tokens.iter().map(u32::to_string).collect();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({
                ORDER_KEY: order.join(","),
                SOURCE_KEY: self.source,
                TOKENS_KEY: tokens.join(","),
            }),
        );
        let mut offset = 0usize;
        for t in &self.tensors {
            let len = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            if len != Some(t.data.len()) {
                return Err(Error::model(format!(
                    "trace tensor '{}': shape {:?} does not hold its {} values",
                    t.name,
                    t.shape,
                    t.data.len()
                )));
            }
            if header.contains_key(&t.name) {
                return Err(Error::model(format!(
                    "trace tensor '{}' appears twice (or is a reserved name)",
                    t.name
                )));
            }
            let end = offset + t.data.len() * 4;
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut head =
            serde_json::to_vec(&header).map_err(|e| Error::model(format!("trace header: {e}")))?;
        head.resize(head.len().next_multiple_of(8), b' ');
        let mut out = Vec::with_capacity(8 + head.len() + offset);
        out.extend_from_slice(&(head.len() as u64).to_le_bytes());
        out.extend_from_slice(&head);
        for t in &self.tensors {
            out.extend(t.data.iter().flat_map(|x| x.to_le_bytes()));
        }
        Ok(out)
    }

    /// Reads the trace file at `path` (see [`Trace::from_safetensors`]).
    pub fn read(path: &Path) -> Result<Trace> {
        let bytes = crate::files::read_regular(path)?;
        Trace::from_safetensors(&bytes, &path.display().to_string())
    }

    /// Parses a trace file's bytes; `what` (its path) names it in errors. The file must
    /// be safetensors with at least one tensor, every tensor F32, F16 or BF16 (read as
    /// f32), and the [`TOKENS_KEY`] metadata; [`ORDER_KEY`], when present, must name
    /// exactly the file's tensors (without it, the order of the data is taken).
    pub fn from_safetensors(bytes: &[u8], what: &str) -> Result<Trace> {
        let bad = |msg: String| Error::model(format!("{what}: {msg}"));
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        let (_, meta) = SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("not a safetensors file: {e}")))?;
        if st.is_empty() {
            return Err(bad("holds no tensors, so it is not a trace".into()));
        }
        let keys = meta.metadata().clone().unwrap_or_default();
        let tokens = match keys.get(TOKENS_KEY) {
            Some(s) => parse_tokens(s).map_err(|e| bad(format!("{TOKENS_KEY}: {e}")))?,
            None => {
                return Err(bad(format!(
                    "no {TOKENS_KEY} metadata: not a trace written by graft trace or scripts/hf-trace.py"
                )))
            }
        };
        let order = file_order(&keys, &meta).map_err(bad)?;
        let tensors = order
            .iter()
            .map(|name| read_tensor(&st, name).map_err(&bad))
            .collect::<Result<Vec<_>>>()?;
        Ok(Trace {
            tensors,
            tokens,
            source: keys.get(SOURCE_KEY).cloned().unwrap_or_default(),
        })
    }
}

/// Parses comma-separated token ids (`1,2,3`; an empty string is no tokens).
pub fn parse_tokens(s: &str) -> std::result::Result<Vec<u32>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.parse::<u32>()
                .map_err(|e| format!("'{x}' is not a token id ({e})"))
        })
        .collect()
}

/// The names of a file's tensors in execution order: [`ORDER_KEY`] (checked against the
/// tensors present), or the order of their data.
fn file_order(
    keys: &HashMap<String, String>,
    meta: &Metadata,
) -> std::result::Result<Vec<String>, String> {
    let present = meta.offset_keys();
    let Some(order) = keys.get(ORDER_KEY) else {
        return Ok(present);
    };
    let order: Vec<String> = order
        .split(',')
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if let Some(name) = order.iter().find(|n| meta.info(n).is_none()) {
        return Err(format!(
            "{ORDER_KEY} names '{name}', a tensor the file lacks"
        ));
    }
    if let Some(name) = present.iter().find(|n| !order.contains(n)) {
        return Err(format!("tensor '{name}' is missing from {ORDER_KEY}"));
    }
    if order.len() != present.len() {
        return Err(format!("{ORDER_KEY} names a tensor twice"));
    }
    Ok(order)
}

/// Tensor `name` of a trace file, as f32.
fn read_tensor(st: &SafeTensors<'_>, name: &str) -> std::result::Result<TraceTensor, String> {
    let t = st
        .tensor(name)
        .map_err(|e| format!("tensor '{name}': {e}"))?;
    let Some((width, convert)) = f32_reader(t.dtype()) else {
        return Err(format!(
            "tensor '{name}' is {:?}; a trace holds F32 (or F16/BF16) tensors",
            t.dtype()
        ));
    };
    let n = t.data().len() / width;
    let mut data = Vec::new();
    data.try_reserve_exact(n)
        .map_err(|_| format!("tensor '{name}': cannot allocate {n} values"))?;
    data.extend(t.data().chunks_exact(width).map(convert));
    Ok(TraceTensor {
        name: name.to_string(),
        shape: t.shape().to_vec(),
        data,
    })
}

/// Converts one element's little-endian bytes to f32.
type ToF32 = fn(&[u8]) -> f32;

/// The element width of a safetensors dtype a trace may hold and its conversion to f32
/// (little-endian bytes; each converts exactly).
#[allow(clippy::wildcard_enum_match_arm)] // safetensors' own dtype list: the rest is refused
fn f32_reader(d: Dtype) -> Option<(usize, ToF32)> {
    match d {
        Dtype::F32 => Some((4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        Dtype::F16 => Some((2, |b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())),
        Dtype::BF16 => Some((2, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        _ => None,
    }
}

/// Checks that two traces ran over the same tokens (comparing different inputs means
/// nothing); the error names `ours` and `reference` and gives both lists.
pub fn check_same_tokens(ours: &Trace, reference: &Trace, what: &str) -> Result<()> {
    if ours.tokens == reference.tokens {
        return Ok(());
    }
    Err(Error::model(format!(
        "{what} traces other tokens: it has {:?} ({} tokens), this run has {:?} ({} tokens); comparing different inputs means nothing, so run both over the same ids",
        reference.tokens,
        reference.tokens.len(),
        ours.tokens,
        ours.tokens.len()
    )))
}

/// Summary statistics of a tensor: over its finite values, with the count of the others.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stats {
    /// Mean of the finite values (NaN when there are none).
    pub mean: f64,
    /// Standard deviation (population) of the finite values.
    pub std: f64,
    /// Smallest finite value.
    pub min: f64,
    /// Largest finite value.
    pub max: f64,
    /// Root mean square of the finite values.
    pub rms: f64,
    /// How many values are NaN or infinite.
    pub non_finite: usize,
}

/// The [`Stats`] of `data`.
pub fn stats(data: &[f32]) -> Stats {
    let (mut n, mut sum, mut sum2) = (0usize, 0f64, 0f64);
    let (mut min, mut max) = (f64::INFINITY, f64::NEG_INFINITY);
    for &x in data.iter().filter(|x| x.is_finite()) {
        let x = f64::from(x);
        n += 1;
        sum += x;
        sum2 += x * x;
        min = min.min(x);
        max = max.max(x);
    }
    let non_finite = data.len() - n;
    if n == 0 {
        return Stats {
            mean: f64::NAN,
            std: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
            rms: f64::NAN,
            non_finite,
        };
    }
    let mean = sum / n as f64;
    Stats {
        mean,
        std: (sum2 / n as f64 - mean * mean).max(0.0).sqrt(),
        min,
        max,
        rms: (sum2 / n as f64).sqrt(),
        non_finite,
    }
}

/// How far one tensor is from its reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Diff {
    /// sum((a-b)^2) / sum(b^2), `b` the reference: 0 when both are all zero, infinite
    /// when only the reference is; NaN when either holds a NaN or an infinity.
    pub nmse: f64,
    /// The largest |a - b| (NaN when a difference is not finite).
    pub max_abs: f64,
    /// The flat index of the largest difference (the first non-finite one, if any);
    /// `None` for empty tensors.
    pub at: Option<usize>,
}

/// The [`Diff`] of `a` against the reference `b`, which must have the same length.
pub fn diff(a: &[f32], b: &[f32]) -> Diff {
    debug_assert_eq!(a.len(), b.len());
    let (mut d2, mut b2, mut finite) = (0f64, 0f64, true);
    let mut worst: Option<(usize, f64)> = None;
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        finite &= x.is_finite() && y.is_finite();
        let (x, y) = (f64::from(x), f64::from(y));
        let d = (x - y).abs();
        d2 += d * d;
        b2 += y * y;
        // The largest difference; the first that is not finite (NaN or infinite) stays.
        let take = match worst {
            None => true,
            Some((_, w)) => w.is_finite() && (d.is_nan() || d > w),
        };
        if take {
            worst = Some((i, d));
        }
    }
    let nmse = match (finite, b2 == 0.0, d2 == 0.0) {
        (false, _, _) => f64::NAN,
        (true, true, true) => 0.0,
        (true, true, false) => f64::INFINITY,
        (true, false, _) => d2 / b2,
    };
    Diff {
        nmse,
        max_abs: worst.map_or(0.0, |(_, d)| d),
        at: worst.map(|(i, _)| i),
    }
}

/// Where in a tensor a flat index lies: the token (the outermost index) and the flat
/// index, with both sides' values there.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Position {
    /// The token index (the first dimension).
    pub token: usize,
    /// The flat (row-major) index.
    pub flat: usize,
    /// Our value there.
    pub ours: f32,
    /// The reference's value there.
    pub reference: f32,
}

/// One tensor of a comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct Compared {
    /// The name both traces give it.
    pub name: String,
    /// Our shape.
    pub shape: Vec<usize>,
    /// The reference's shape.
    pub reference_shape: Vec<usize>,
    /// How far ours is from the reference (`None` when the shapes differ).
    pub diff: Option<Diff>,
    /// Where the largest difference is (`None` when the shapes differ or it is empty).
    pub position: Option<Position>,
    /// Whether it crosses the threshold: NMSE above it or not finite, or another shape.
    pub diverged: bool,
    /// Our statistics.
    pub stats: Stats,
    /// The reference's statistics.
    pub reference_stats: Stats,
}

/// The result of [`compare`].
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    /// Every name both traces have, in our execution order.
    pub compared: Vec<Compared>,
    /// The index in `compared` of the first divergent tensor.
    pub first_divergence: Option<usize>,
    /// Names only we have (execution order).
    pub only_ours: Vec<String>,
    /// Names only the reference has (its order).
    pub only_reference: Vec<String>,
    /// The threshold compared with.
    pub threshold: f64,
}

impl Comparison {
    /// The first divergent tensor, if any.
    pub fn divergence(&self) -> Option<&Compared> {
        self.first_divergence.and_then(|i| self.compared.get(i))
    }

    /// The compared tensor with the largest NMSE (a shape mismatch or a NaN counts as
    /// infinite).
    pub fn worst(&self) -> Option<&Compared> {
        let key = |c: &Compared| match c.diff {
            Some(d) if !d.nmse.is_nan() => d.nmse,
            Some(_) | None => f64::INFINITY,
        };
        self.compared
            .iter()
            .max_by(|a, b| key(a).total_cmp(&key(b)))
    }
}

/// Compares `ours` against `reference` tensor by tensor, in our execution order (see
/// the module docs); `threshold` is the largest NMSE that is not a divergence.
pub fn compare(ours: &[TraceTensor], reference: &[TraceTensor], threshold: f64) -> Comparison {
    let by_name: HashMap<&str, &TraceTensor> =
        reference.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut compared = Vec::new();
    let mut only_ours = Vec::new();
    for t in ours {
        match by_name.get(t.name.as_str()) {
            Some(r) => compared.push(compare_one(t, r, threshold)),
            None => only_ours.push(t.name.clone()),
        }
    }
    let ours_names: std::collections::HashSet<&str> =
        ours.iter().map(|t| t.name.as_str()).collect();
    let only_reference = reference
        .iter()
        .filter(|t| !ours_names.contains(t.name.as_str()))
        .map(|t| t.name.clone())
        .collect();
    Comparison {
        first_divergence: compared.iter().position(|c| c.diverged),
        compared,
        only_ours,
        only_reference,
        threshold,
    }
}

/// One tensor against its reference.
fn compare_one(t: &TraceTensor, r: &TraceTensor, threshold: f64) -> Compared {
    let same = t.shape == r.shape && t.data.len() == r.data.len();
    let diff = same.then(|| diff(&t.data, &r.data));
    let row: usize = t.shape.iter().skip(1).product();
    let position = diff.and_then(|d| d.at).map(|flat| Position {
        token: flat / row.max(1),
        flat,
        ours: t.data[flat],
        reference: r.data[flat],
    });
    Compared {
        name: t.name.clone(),
        shape: t.shape.clone(),
        reference_shape: r.shape.clone(),
        diverged: diff.is_none_or(|d| d.nmse.is_nan() || d.nmse > threshold),
        diff,
        position,
        stats: stats(&t.data),
        reference_stats: stats(&r.data),
    }
}
