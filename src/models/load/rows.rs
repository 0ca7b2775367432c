//! Host-side conversion of weight rows between dtypes (F32, F16, BF16 and the block
//! types), rows in parallel with rayon: what loading with `--quantize` and `graft convert`
//! do to each tensor, and the row permutation between HF's and llama.cpp's rope layouts.

use std::borrow::Cow;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::quant::{dequantize_row, quantize_row};

use crate::models::arch::Source;

/// Decodes one row of `dtype` (bytes) into f32 values.
fn decode_row(dtype: DType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    match dtype {
        DType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Quant(q) => dequantize_row(q, src, dst)?,
        DType::I32 => return Err(Error::model("i32 is not a weight dtype")),
    }
    Ok(())
}

/// Encodes f32 values into one row of `dtype` (F16 and BF16 round to nearest even).
fn encode_row(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match dtype {
        DType::F32 => {
            for (c, v) in dst.chunks_exact_mut(4).zip(src) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, v) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (c, v) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        DType::Quant(q) => quantize_row(q, src, dst)?,
        DType::I32 => return Err(Error::model("i32 is not a weight dtype")),
    }
    Ok(())
}

/// Converts `src`, whole rows of `row_len` elements in `from`, into rows of `to`
/// (quantizing or dequantizing through f32), rows in parallel. `name` is for errors.
pub fn convert_rows(
    name: &str,
    src: &[u8],
    from: DType,
    to: DType,
    row_len: usize,
) -> Result<Vec<u8>> {
    let (sb, db) = (from.row_bytes(row_len), to.row_bytes(row_len));
    if !row_len.is_multiple_of(from.block_size())
        || !row_len.is_multiple_of(to.block_size())
        || sb == 0
    {
        return Err(Error::model(format!(
            "tensor '{name}': rows of {row_len} elements do not fit the blocks of {from} and {to}"
        )));
    }
    if !src.len().is_multiple_of(sb) {
        return Err(Error::model(format!(
            "tensor '{name}': {} bytes are not whole rows of {row_len} {from} elements ({sb} bytes)",
            src.len()
        )));
    }
    let rows = src.len() / sb;
    let mut out = vec![0u8; rows * db];
    out.par_chunks_exact_mut(db)
        .zip(src.par_chunks_exact(sb))
        .try_for_each_init(
            || vec![0f32; row_len],
            |buf, (d, s)| {
                decode_row(from, s, buf)?;
                encode_row(to, buf, d)
            },
        )
        .map_err(|e| Error::model(format!("tensor '{name}': {e}")))?;
    Ok(out)
}

/// The rows of a Q or K projection (`n_head` heads of `rows / n_head` rows, each
/// `row_bytes` bytes) moved from HF's rope layout to llama.cpp's (`to_ggml`) or back.
///
/// HF Llama rotates pairs `(i, i + d/2)` of a head of `d` rows (NeoX style); llama.cpp's
/// converter reorders each head's rows so that the pairs are adjacent `(2i, 2i + 1)`, the
/// layout of ggml's "normal" rope: ggml row `2i + h` is HF row `h * d/2 + i`. Rows move
/// whole, so any dtype (block types included) is permuted exactly.
pub fn permute_rope_rows(data: &[u8], n_head: usize, row_bytes: usize, to_ggml: bool) -> Vec<u8> {
    let rows = data.len() / row_bytes;
    let d = rows / n_head;
    let mut out = vec![0u8; data.len()];
    for head in 0..n_head {
        for i in 0..d / 2 {
            for h in 0..2 {
                let hf = head * d + h * (d / 2) + i;
                let gg = head * d + 2 * i + h;
                let (from, to) = if to_ggml { (hf, gg) } else { (gg, hf) };
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&data[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    out
}

/// The file shape (outermost first) that holds the weight of `shape` (outermost first,
/// `[out, in]` for a matrix) as `src` describes it: transposed (`[in, out]`) and/or one
/// of `n` equal parts of the outermost dimension (the rows of a matrix, the elements of
/// a vector).
pub fn source_shape(shape: &[usize], src: &Source) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let Some((_, n)) = src.rows {
        s[0] *= n;
    }
    if src.transposed && s.len() == 2 {
        s.reverse();
    }
    s
}

/// The bytes of the weight `src` describes inside its file tensor `data` (of `dtype`,
/// already checked to have [`source_shape`]): transposed back to `[out, in]` if the file
/// stores it `[in, out]` (float dtypes only), then part `i` of `n` of the rows.
pub fn source_bytes<'a>(
    data: &'a [u8],
    dtype: DType,
    shape: &[usize],
    src: &Source,
) -> Result<Cow<'a, [u8]>> {
    let (rows, row_len) = match shape {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        // a stack of matrices (the experts'): rows of all of them
        [e, r, c] => (*e * *r, *c),
        _ => {
            return Err(Error::model(format!(
                "tensor '{}': not a matrix, a stack of matrices or a vector",
                src.name
            )))
        }
    };
    let full_rows = src.rows.map_or(rows, |(_, n)| rows * n);
    let mut out = Cow::Borrowed(data);
    if src.transposed && shape.len() == 2 {
        let es = match dtype {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::Quant(_) => {
                return Err(Error::model(format!(
                    "tensor '{}': a transposed {dtype} matrix cannot be read (float only)",
                    src.name
                )))
            }
        };
        // file [row_len, full_rows] -> [full_rows, row_len]
        let mut t = vec![0u8; data.len()];
        for i in 0..row_len {
            for j in 0..full_rows {
                let from = (i * full_rows + j) * es;
                let to = (j * row_len + i) * es;
                t[to..to + es].copy_from_slice(&data[from..from + es]);
            }
        }
        out = Cow::Owned(t);
    }
    let Some((i, n)) = src.rows else {
        return Ok(out);
    };
    let part = out.len() / n;
    Ok(match out {
        Cow::Borrowed(b) => Cow::Borrowed(&b[i * part..(i + 1) * part]),
        Cow::Owned(v) => Cow::Owned(v[i * part..(i + 1) * part].to_vec()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transposed, fused `[in, 3 * out]` tensor (GPT-2's `c_attn`) gives each part
    /// back as `[out, in]` rows.
    #[test]
    fn sources_transpose_and_split() {
        // weight [out 2, in 3] per part, 3 parts; file [in 3, 6] holds w_p[o][i] at
        // file[i][p * 2 + o]
        let w = |p: usize, o: usize, i: usize| (100 * p + 10 * o + i) as f32;
        let mut file = vec![0f32; 18];
        for p in 0..3 {
            for o in 0..2 {
                for i in 0..3 {
                    file[i * 6 + p * 2 + o] = w(p, o, i);
                }
            }
        }
        let bytes: &[u8] = bytemuck::cast_slice(&file);
        for p in 0..3 {
            let src = Source {
                name: "c_attn".into(),
                rows: Some((p, 3)),
                transposed: true,
            };
            assert_eq!(source_shape(&[2, 3], &src), [3, 6]);
            let got = source_bytes(bytes, DType::F32, &[2, 3], &src).unwrap();
            let got: &[f32] = bytemuck::cast_slice(&got);
            let want: Vec<f32> = (0..2)
                .flat_map(|o| (0..3).map(move |i| w(p, o, i)))
                .collect();
            assert_eq!(got, want.as_slice());
        }
        let bias = Source {
            name: "b".into(),
            rows: Some((1, 3)),
            transposed: false,
        };
        let v: Vec<f32> = (0..6).map(|x| x as f32).collect();
        let got = source_bytes(bytemuck::cast_slice(&v), DType::F32, &[2], &bias).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&got), &[2.0, 3.0]);
    }

    #[test]
    fn conversions_round_trip_within_the_type() {
        let vals: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
            .collect();
        let src: Vec<u8> = bytemuck::cast_slice(&vals).to_vec();
        for to in [
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            let q = convert_rows("x", &src, DType::F32, to, 256).unwrap();
            assert_eq!(q.len(), 2 * to.row_bytes(256));
            let back = convert_rows("x", &q, to, DType::F32, 256).unwrap();
            let back: &[f32] = bytemuck::cast_slice(&back);
            let worst = vals
                .iter()
                .zip(back)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(worst < 0.15, "{to}: {worst}");
            assert!(
                worst > 0.0 || to == DType::F16,
                "{to} is lossy on these values"
            );
        }
        let err = convert_rows("w", &src, DType::F32, DType::Q4_K, 64).unwrap_err();
        assert!(err.to_string().contains("'w'"), "{err}");
    }

    #[test]
    fn rope_permutation_pairs_rows_and_inverts() {
        // 2 heads of 4 one-byte rows: HF head rows [0 1 | 2 3] -> ggml [0 2 1 3].
        let data = [0u8, 1, 2, 3, 4, 5, 6, 7];
        let g = permute_rope_rows(&data, 2, 1, true);
        assert_eq!(g, [0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(permute_rope_rows(&g, 2, 1, false), data);
        let wide: Vec<u8> = (0..96).collect();
        let there = permute_rope_rows(&wide, 3, 4, true);
        assert_eq!(permute_rope_rows(&there, 3, 4, false), wide);
    }
}
