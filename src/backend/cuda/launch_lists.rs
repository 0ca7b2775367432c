//! Launch lists of model plans, checked against snapshots (no GPU needed): the decode and
//! prefill plans of the presets (two layers each) with several weight and cache types,
//! frozen weights in split rows and the lowering's options, lowered at fixed fake
//! addresses; every launch is written down with its kernel, grid, block, launch order and
//! argument bytes, every GEMM and all-reduce with all its fields, and each plan's constant
//! region and scratch size. The files in `tests/fixtures/launches/` hold what the lowering
//! launches; any change to what a model plan launches shows up here as a difference, which is how a change of the lowering's structure is known to leave the
//! launches (and so the speed) as they were.
//!
//! On a difference the test writes what it got to `target/launch-lists/` for a diff.

use std::fmt::Write as _;
use std::path::PathBuf;

use super::lowering::{DevOp, Lowering};
use super::split::{coalesce, SplitRows};
use super::tests::lower_plan;
use crate::graph::{BufferId, DType, Loc, Op, Plan};
use crate::models::arch::config::Config;
use crate::models::arch::presets;
use crate::models::blocks::kv_cache::KvCache;
use crate::models::blocks::{build_decode, build_prefill};
use crate::models::load::options::CacheTypes;
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::weights::Weights;
use crate::quant::split::has_split_rows;

const WEIGHTS: BufferId = BufferId(1);
const CACHE: BufferId = BufferId(2);
const CONSTS: u64 = 7 << 40;
const SCRATCH: u64 = 9 << 40;
const ERR: u64 = 11 << 40;

/// The fake device address of a plan location: the arena at 0x1000, buffer `b` at
/// `(b + 1) << 40`.
fn addr(loc: Loc) -> u64 {
    match loc {
        Loc::Arena(off) => 0x1000 + off as u64,
        Loc::Buffer(b, off) => buffer_base(b) + off as u64,
    }
}

fn buffer_base(b: BufferId) -> u64 {
    (u64::from(b.0) + 1) << 40
}

/// How a plan is lowered.
#[derive(Clone, Copy)]
struct Options {
    fusion: bool,
    mmvq: bool,
    small_dq: bool,
    split: bool,
    sms: usize,
}

/// The backend's defaults.
const DEFAULT: Options = Options {
    fusion: true,
    mmvq: true,
    small_dq: true,
    split: false,
    sms: 132,
};

/// The split-row regions a model's `freeze` would make of `plan`'s weights: every
/// block-quantized matrix a mul_mat reads that has split rows and that no get_rows reads.
fn split_regions(plan: &Plan) -> Vec<SplitRows> {
    let tables: Vec<Loc> = plan
        .steps
        .iter()
        .filter(|s| s.op == Op::GetRows)
        .map(|s| s.src[0].loc)
        .collect();
    let mut regions: Vec<SplitRows> = Vec::new();
    for s in plan.steps.iter().filter(|s| s.op == Op::MulMat) {
        let a = &s.src[0];
        let (Loc::Buffer(b, off), Some(q)) = (a.loc, a.dtype.quant()) else {
            continue;
        };
        if !has_split_rows(q)
            || tables.contains(&a.loc)
            || regions.iter().any(|r| r.overlaps(b, off, 1))
        {
            continue;
        }
        let base = buffer_base(b);
        regions.extend(SplitRows::new(&s.name, b, base, off, q, a.ne[0], a.ne[1]));
    }
    coalesce(&mut regions);
    regions
}

/// The launch list of `plan` lowered with `opt`.
fn launch_list(plan: &Plan, opt: Options) -> String {
    let regions = if opt.split {
        split_regions(plan)
    } else {
        Vec::new()
    };
    let resolve = addr;
    let mut lw = Lowering {
        consts_base: CONSTS,
        scratch_base: SCRATCH,
        err: ERR,
        small_dq: opt.small_dq,
        split: &regions,
        sms: opt.sms,
        ..Lowering::new(&resolve, opt.mmvq, 1)
    };
    let steps = lower_plan(plan, &mut lw, opt.fusion, |i| i as i64)
        .unwrap_or_else(|(s, e)| panic!("{} not supported: {e}", s.name));
    let mut out = String::new();
    writeln!(
        out,
        "scratch {} consts {} {:016x} regions {}",
        lw.scratch_need,
        lw.consts.len(),
        fnv(&lw.consts),
        regions.len()
    )
    .unwrap();
    for (i, ops) in steps.iter().enumerate() {
        for op in ops {
            writeln!(out, "{i} {}", describe(op)).unwrap();
        }
    }
    out
}

/// One device operation, every field written.
fn describe(op: &DevOp) -> String {
    match op {
        DevOp::Kernel(l) => {
            let hex: String = l.args.words().iter().map(|w| format!("{w:x}.")).collect();
            format!(
                "{} g{:?} b{:?} early {} per_sm {} args {hex}",
                l.kernel.name, l.grid, l.block, l.early, l.per_sm
            )
        }
        DevOp::Gemm(g) => format!(
            "gemm t{} {} mnk {} {} {} {} a {:x} {} b {:x} {} c {:x} {} batch {} beta {} ptrs {:x}",
            g.transa,
            g.transb,
            g.m,
            g.n,
            g.k,
            g.dtype,
            g.a,
            g.lda,
            g.b,
            g.ldb,
            g.c,
            g.ldc,
            g.batch,
            g.beta,
            g.ptrs
        ),
        DevOp::AllReduce(a) => format!("all_reduce {:x} {:x} {}", a.send, a.recv, a.count),
    }
}

/// FNV-1a of `bytes`.
fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Preset `name` cut to two layers (the tiny preset as it is).
fn config(name: &str) -> Config {
    let mut cfg = presets::preset(name).unwrap();
    cfg.num_hidden_layers = cfg.num_hidden_layers.min(2);
    cfg
}

/// A decode (over 512 positions) or prefill (7 tokens after 3) plan of `cfg`.
fn plan(cfg: &Config, weights: QuantPlan, cache: CacheTypes, decode: bool) -> Plan {
    let pick = |r, l| weights.pick(r, l, cfg).dtype;
    let w = Weights::layout(cfg, &pick, WEIGHTS);
    let kv = KvCache::layout(cfg, 1024, cache, CACHE);
    let mg = match decode {
        true => build_decode(cfg, &w, &kv, 512),
        false => build_prefill(cfg, &w, &kv, 7, 3, false),
    };
    mg.unwrap().plan().unwrap()
}

/// The cases of preset `name`: (title, launch list).
fn cases(name: &str) -> String {
    let cfg = config(name);
    let flash = CacheTypes::default();
    let classic = CacheTypes {
        flash_attn: false,
        ..flash
    };
    let q8_cache = CacheTypes {
        k: DType::Q8_0,
        v: DType::Q8_0,
        flash_attn: true,
    };
    let split = Options {
        split: true,
        ..DEFAULT
    };
    let mut list: Vec<(String, QuantPlan, CacheTypes, bool, Options)> = vec![
        (
            "f16 flash decode".into(),
            QuantPlan::F16,
            flash,
            true,
            DEFAULT,
        ),
        (
            "f16 flash prefill".into(),
            QuantPlan::F16,
            flash,
            false,
            DEFAULT,
        ),
        (
            "f16 classic decode".into(),
            QuantPlan::F16,
            classic,
            true,
            DEFAULT,
        ),
        (
            "bf16 flash decode".into(),
            QuantPlan::BF16,
            flash,
            true,
            DEFAULT,
        ),
        (
            "q4_0 flash decode".into(),
            QuantPlan::Q4_0,
            flash,
            true,
            DEFAULT,
        ),
        (
            "q4_0 flash prefill".into(),
            QuantPlan::Q4_0,
            flash,
            false,
            DEFAULT,
        ),
        (
            "q4_0 flash decode split".into(),
            QuantPlan::Q4_0,
            flash,
            true,
            split,
        ),
        (
            "q4_0 classic decode".into(),
            QuantPlan::Q4_0,
            classic,
            true,
            DEFAULT,
        ),
        (
            "q4_k_m flash decode split".into(),
            QuantPlan::Q4_K_M,
            flash,
            true,
            split,
        ),
        (
            "q4_k_m classic decode".into(),
            QuantPlan::Q4_K_M,
            classic,
            true,
            DEFAULT,
        ),
        (
            "q8_0 q8_0-cache decode".into(),
            QuantPlan::Q8_0,
            q8_cache,
            true,
            DEFAULT,
        ),
        (
            "q8_0 q8_0-cache decode split".into(),
            QuantPlan::Q8_0,
            q8_cache,
            true,
            split,
        ),
        (
            "q5_k_m flash decode split".into(),
            QuantPlan::Q5_K_M,
            flash,
            true,
            split,
        ),
    ];
    if name == "tiny" || name == "llama2-7b" {
        let variants = [
            (
                "fusion off",
                Options {
                    fusion: false,
                    ..DEFAULT
                },
            ),
            (
                "mmvq off",
                Options {
                    mmvq: false,
                    small_dq: false,
                    ..DEFAULT
                },
            ),
            (
                "mmvq on",
                Options {
                    small_dq: false,
                    ..DEFAULT
                },
            ),
            ("108 SMs split", Options { sms: 108, ..split }),
        ];
        for (what, opt) in variants {
            for (wt, cache) in [
                (QuantPlan::Q4_0, flash),
                (QuantPlan::F16, classic),
                (QuantPlan::Q6_K, flash),
            ] {
                let title = format!("{} {} decode {what}", wt.name(), cache_name(cache));
                list.push((title, wt, cache, true, opt));
            }
        }
        list.push((
            "f32 flash decode".into(),
            QuantPlan::F32,
            flash,
            true,
            DEFAULT,
        ));
        list.push((
            "f32 classic prefill".into(),
            QuantPlan::F32,
            classic,
            false,
            DEFAULT,
        ));
    }
    let mut out = String::new();
    for (title, wt, cache, decode, opt) in list {
        writeln!(out, "## {title}").unwrap();
        out.push_str(&launch_list(&plan(&cfg, wt, cache, decode), opt));
    }
    out
}

fn cache_name(c: CacheTypes) -> &'static str {
    match c.flash_attn {
        true => "flash",
        false => "classic",
    }
}

/// The launch lists of every preset equal the snapshots.
#[test]
fn launch_lists_match_the_snapshots() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut differ = Vec::new();
    for name in presets::NAMES {
        let got = cases(name);
        let path = root.join(format!("tests/fixtures/launches/{name}.txt"));
        let want = std::fs::read_to_string(&path).unwrap_or_default();
        if got != want {
            let dir = root.join("target/launch-lists");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("{name}.txt")), &got).unwrap();
            differ.push(name);
        }
    }
    assert!(
        differ.is_empty(),
        "launch lists of {differ:?} differ from tests/fixtures/launches/ (what the lowering \
         gives now is in target/launch-lists/)"
    );
}
