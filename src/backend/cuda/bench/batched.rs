//! The batched products of block-quantized weights in `graft bench-ops` (Q4_0, Q8_0, Q4_K
//! on the Llama-2-7B shapes by 8 to 512 columns: a batched decode step of that many
//! sequences, or a prefill chunk of that many tokens), each on every path its width can
//! take ([`QuantPath`]: the decode kernels at 8 columns, the int8 and F16 tensor-core
//! products at every width (the F16 one up to `MMQ_MAX_COLS`), the F16 copy of the
//! weights for cuBLAS from 16 on). Every node of a case
//! reads one shared input, so the tensor-core product's Q8_1 copy is made once, as a
//! model's fused norm makes it. The bytes are the weights', so the fraction of the copy
//! bandwidth is that of the weight-read roofline; [`BatchedRow`] puts the paths side by
//! side, from which the thresholds of `lower::mul_mat_q` are set.

use serde::Serialize;

use super::{quant_leaf, reps_for, run_case, BenchRow, Case};
use crate::backend::cuda::lower::mmq::{f16_from_cols, MMQ_FROM_COLS, MMQ_MAX_COLS};
use crate::backend::cuda::lowering::QuantPath;
use crate::backend::cuda::CudaBackend;
use crate::backend::fusion::MAX_DECODE_COLS;
use crate::error::Result;
use crate::graph::DType;
use crate::quant::QType;

/// One batched product of block-quantized weights on each path that takes its width.
#[derive(Clone, Debug, Serialize)]
pub struct BatchedRow {
    /// The weights: type and shape `[k, m]`.
    pub weights: String,
    /// Activation columns.
    pub n: usize,
    /// Microseconds a replayed graph node reads the weights in at the copy bandwidth.
    pub roofline_us: f64,
    /// Microseconds per node in a replayed graph on the decode kernels (at most
    /// `MAX_DECODE_COLS` columns).
    pub decode_us: Option<f64>,
    /// The same on the int8 tensor-core product.
    pub mmq_us: Option<f64>,
    /// The same on the F16 tensor-core product (`mmr_*` for the 32-element types, `mmh_*`
    /// for the others).
    pub mmh_us: Option<f64>,
    /// The same with the weights dequantized to F16 for cuBLAS (more columns than the
    /// decode kernels take).
    pub dequant_us: Option<f64>,
    /// The path the thresholds give this width.
    pub auto: String,
}

/// The rows as a markdown table: microseconds per node in a replayed graph on each path,
/// with the fraction of the weight-read roofline.
pub fn table(rows: &[BatchedRow]) -> String {
    let cell = |us: Option<f64>, roof: f64| {
        us.map_or("".into(), |t| format!("{t:.2} ({:.0}%)", 100.0 * roof / t))
    };
    let mut s = String::from(
        "\n| weights | columns | roofline us | decode us | mmq us | F16 cores (mmr/mmh) us | F16 + cuBLAS us | thresholds pick |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {:.2} | {} | {} | {} | {} | {} |\n",
            r.weights,
            r.n,
            r.roofline_us,
            cell(r.decode_us, r.roofline_us),
            cell(r.mmq_us, r.roofline_us),
            cell(r.mmh_us, r.roofline_us),
            cell(r.dequant_us, r.roofline_us),
            r.auto
        ));
    }
    s
}

/// A product of block-quantized weights `w` [k, m] of `q` by `n` F32 columns on `path`
/// (`Auto`: the decode kernels, at `MAX_DECODE_COLS` columns or fewer), every node
/// reading one shared input. The bytes are the weights'.
fn case<'a>(q: QType, k: usize, m: usize, n: usize, path: QuantPath) -> Case<'a> {
    let what = match path {
        QuantPath::Auto => "decode kernels",
        QuantPath::Mmq => "int8 tensor cores",
        QuantPath::Mmh => "F16 tensor cores",
        QuantPath::Dequant => "F16 copy + cuBLAS",
    };
    let bytes = (DType::Quant(q).row_bytes(k) * m) as f64;
    let shared = std::cell::Cell::new(None);
    Case {
        name: format!("mul_mat {q} [{k}, {m}] x f32 [{k}, {n}] ({what}; bytes: the weights)"),
        reps: reps_for(bytes),
        bytes,
        flops: 2.0 * (k * m * n) as f64,
        build: Box::new(move |be, g, r| {
            // Lowering reads the switches when the plan loads, after every node is built.
            be.set_mmvq(None);
            be.set_quant_path(path);
            let x = match shared.get() {
                Some(x) => x,
                None => {
                    let x = g.input("x", DType::F32, &[k, n])?;
                    shared.set(Some(x));
                    x
                }
            };
            let w = quant_leaf(be, g, &format!("w{r}"), q, &[k, m], r as u64)?;
            g.mul_mat(w, x)
        }),
    }
}

/// Times the batched products of `q` on the Llama-2-7B shapes by 8 to 512 columns on
/// every path their width can take (the cases whose name contains `filter`, when given);
/// appends each case to `rows` and returns the paths side by side (the widths with a
/// case run).
pub fn cases(
    be: &mut CudaBackend,
    q: QType,
    copy_gb_s: f64,
    iters: usize,
    filter: Option<&str>,
    rows: &mut Vec<BenchRow>,
) -> Result<Vec<BatchedRow>> {
    let mut out = Vec::new();
    for (k, m) in [(4096, 4096), (4096, 11008), (11008, 4096)] {
        for n in [8, 16, 32, 64, 128, 256, 512] {
            let mut time = |path| -> Result<Option<f64>> {
                let c = case(q, k, m, n, path);
                if filter.is_some_and(|f| !c.name.contains(f)) {
                    return Ok(None);
                }
                let row = run_case(be, copy_gb_s, iters, c)?;
                let us = row.graph_us;
                rows.push(row);
                Ok(Some(us))
            };
            let decode_us = match n <= MAX_DECODE_COLS {
                true => time(QuantPath::Auto)?,
                false => None,
            };
            let mmq_us = time(QuantPath::Mmq)?;
            let mmh_us = match n <= MMQ_MAX_COLS {
                true => time(QuantPath::Mmh)?,
                false => None,
            };
            let dequant_us = match n > MAX_DECODE_COLS {
                true => time(QuantPath::Dequant)?,
                false => None,
            };
            if [decode_us, mmq_us, mmh_us, dequant_us]
                .iter()
                .all(Option::is_none)
            {
                continue;
            }
            let auto = match n {
                ..MMQ_FROM_COLS => "decode",
                _ if n < f16_from_cols(DType::Quant(q), be.mmr) => "mmq",
                _ if n <= MMQ_MAX_COLS => "F16 cores",
                _ => "F16 + cuBLAS",
            };
            out.push(BatchedRow {
                weights: format!("{q} [{k}, {m}]"),
                n,
                roofline_us: (DType::Quant(q).row_bytes(k) * m) as f64 / copy_gb_s / 1e3,
                decode_us,
                mmq_us,
                mmh_us,
                dequant_us,
                auto: auto.into(),
            });
        }
    }
    be.set_quant_path(QuantPath::Auto);
    Ok(out)
}
