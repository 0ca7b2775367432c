//! Frozen Q4_0 and IQ4_NL weights on the CPU backend, which keeps them in rows of eight
//! where the CPU has AVX-512 VNNI (`graft::quant::rows8`): products give what the same
//! weights give unfrozen (bit for bit on the f32 dot path and for two columns or more on
//! the Q8_1 path; a decode step's single column within the f32 order of sums), reading back gives ggml's bytes, and writes, fills, overlapping
//! freezes and plans reading the weights other than as mul_mat weights are errors that
//! name the tensor. On a CPU without those features freezing changes nothing, and the
//! same checks hold.

use graft::backend::cpu::CpuBackend;
use graft::backend::FrozenTensor;
use graft::ops::mul_mat::QuantDot;
use graft::quant::{rows8, QType};
use proptest::prelude::*;

use crate::common;
use crate::quant_strategies::{self as qs, QCase};

/// The f32 results of a run.
fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Case `c` frozen against unfrozen on the `dot` path.
fn check(c: &QCase, dot: QuantDot) -> Result<(), TestCaseError> {
    let mut be = CpuBackend::new();
    be.set_quant_dot(dot);
    let (_, want) = qs::run(c, &mut be).map_err(|e| TestCaseError::fail(e.to_string()))?;
    let frozen = qs::run_frozen(c, &mut be);
    // rows of eight take whole groups of dense rows: a view of part of each row is refused
    let interleaved = rows8::usable() && c.rows.is_multiple_of(rows8::ROWS);
    if interleaved && c.pad > 0 {
        match frozen {
            Err(e) => prop_assert!(e.to_string().contains("frozen weight w"), "{e}"),
            Ok(_) => prop_assert!(false, "{c:?}: a view of part of each frozen row loaded"),
        }
        return Ok(());
    }
    let (_, got) = frozen.map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
    let (got, want) = (floats(&got), floats(&want));
    // the f32 path, and the prefill kernels (two columns or more) of both layouts, add
    // the same terms in the same order
    if dot == QuantDot::F32 || c.n > 1 {
        prop_assert!(
            got == want,
            "{c:?} ({dot:?}): frozen weights gave other values"
        );
    }
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        prop_assert!(
            (g - w).abs() <= 2e-5 * scale,
            "{c:?} ({dot:?}): element {i}: frozen {g} vs {w}"
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::config(48))]

    /// Random row counts (whole groups of eight or not), row lengths, offsets, padded rows,
    /// decode and prefill widths, broadcast batches of the weights, on both dot paths.
    #[test]
    fn prop_frozen_rows8_match_unfrozen(
        q in proptest::sample::select(vec![QType::Q4_0, QType::IQ4_NL]),
        blocks in 1usize..=40,
        groups in 1usize..=12,
        extra in proptest::sample::select(vec![0usize, 0, 0, 3]),
        n in proptest::sample::select(vec![1usize, 2, 3, 7, 8, 9, 17, 40]),
        pad in proptest::sample::select(vec![0usize, 0, 0, 1]),
        offset in proptest::sample::select(vec![0usize, 2, 18, 1000]),
        a_batch in proptest::sample::select(vec![[1usize, 1], [2, 1]]),
        f32_dot in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let c = QCase {
            pad,
            offset,
            a_batch,
            ..QCase::mul_mat(q, 32 * blocks, 8 * groups + extra, n, false, seed)
        };
        let dot = if f32_dot { QuantDot::F32 } else { QuantDot::Q8_1 };
        check(&c, dot)?;
    }
}

/// The frozen-weight rules (`check_frozen_rules`) for Q4_0 and IQ4_NL in rows of eight,
/// 24 rows at an offset that is no multiple of a block; `other` starts four rows in.
#[test]
fn frozen_rows8_read_back_and_refuse_writes() {
    let mut be = CpuBackend::new();
    for q in [QType::Q4_0, QType::IQ4_NL] {
        let c = QCase {
            offset: 10,
            ..QCase::mul_mat(q, 96, 24, 1, false, 5)
        };
        let other = FrozenTensor {
            name: "v".into(),
            offset: c.offset + qs::weight_bytes(&c).len() / 24 * 4,
            rows: 8,
            ..qs::frozen(&c)
        };
        qs::check_frozen_rules(&mut be, &c, other, rows8::usable());
    }
}
