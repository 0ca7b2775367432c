//! The fusion pass on the plans of real model graphs (the presets' decode and prefill
//! graphs over weight layouts, no backend) and on hand-made graphs where a pattern is
//! present, or broken by another reader, a layout, a dtype or memory the allocator reused.

use super::{disjoint, fuse, q8_1_input, unfused, Fused, Group, Q8Layout, Target};
use crate::graph::{BufferId, DType, Graph, Op, Plan, TensorId};
use crate::models::arch::config::Config;
use crate::models::arch::presets;
use crate::models::blocks::kv_cache::KvCache;
use crate::models::blocks::moe::weighted_sum;
use crate::models::blocks::{build_decode, build_prefill};
use crate::models::load::options::CacheTypes;
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::weights::Weights;
use crate::quant::QType;

const Q8_1: Target = Target {
    q8_1: true,
    batched_cols: 0,
    batched_cols_32: 0,
    f16_copies: false,
    tensor_cols: 0,
    batched_from: usize::MAX,
    expert_decode_tokens: 4,
    moe_sum_stage: 64,
};
const F32_ACTS: Target = Target {
    q8_1: false,
    batched_cols: 0,
    batched_cols_32: 0,
    f16_copies: false,
    tensor_cols: 0,
    batched_from: usize::MAX,
    expert_decode_tokens: 0,
    moe_sum_stage: 0,
};
/// The CUDA backend's: decode products and batched ones up to 64 columns read Q8_1, and
/// products of 5 columns on take the batched product.
const BATCHED: Target = Target {
    q8_1: true,
    batched_cols: 64,
    batched_cols_32: 64,
    f16_copies: false,
    tensor_cols: 64,
    batched_from: 5,
    expert_decode_tokens: 4,
    moe_sum_stage: 64,
};

/// The name of a group's kind.
fn kind(g: &Group) -> &'static str {
    match &g.fused {
        Fused::Step => "step",
        Fused::RmsNormMul(_) => "rms_norm_mul",
        Fused::SwiGlu(_) => "swiglu",
        Fused::GemvAdd(_) => "gemv_add",
        Fused::ProductAdd(_) => "product_add",
        Fused::RopeStore(_) => "rope_store",
        Fused::Attention(_) => "attention",
        Fused::NormFold(_) => "norm_fold",
        Fused::MoeSum(_) => "moe_sum",
        Fused::ExpertPair(_) => "expert_pair",
    }
}

/// The kinds of the fused groups (steps left as they are not listed).
fn fused_kinds(groups: &[Group]) -> Vec<&'static str> {
    groups.iter().map(kind).filter(|k| *k != "step").collect()
}

fn count(groups: &[Group], k: &str) -> usize {
    groups.iter().filter(|g| kind(g) == k).count()
}

/// What must hold of any plan's groups: they cover every step once, in order; a group's
/// length is its pattern's; each fused step's operands are those of its steps; a
/// [`Fused::NormFold`] is followed by the group that applies its factor (`folded`) and
/// only that one is; a Q8_1 copy is of the activations of the next step, a decode
/// product of block-quantized weights.
fn check_invariants(plan: &Plan, groups: &[Group], target: &Target) {
    let mut next = 0;
    for (i, g) in groups.iter().enumerate() {
        assert_eq!(g.first, next, "groups in order, every step once");
        next += g.len;
        let steps = &plan.steps[g.first..g.first + g.len];
        let after = plan.steps.get(g.first + g.len);
        let folded_before = i > 0 && matches!(groups[i - 1].fused, Fused::NormFold(_));
        let q8 = match &g.fused {
            Fused::Step | Fused::Attention(_) => {
                assert_eq!(g.len, 1);
                None
            }
            Fused::RmsNormMul(n) => {
                assert_eq!(g.len, 2);
                assert_eq!((n.x, n.y), (&steps[0].src[0], &steps[1].dst));
                n.q8.as_ref()
            }
            Fused::SwiGlu(s) => {
                assert_eq!(g.len, 2);
                assert_eq!((s.gate, s.y), (&steps[0].src[0], &steps[1].dst));
                assert_eq!(s.folded, folded_before);
                s.q8.as_ref()
            }
            Fused::GemvAdd(a) => {
                assert_eq!(g.len, 2);
                assert_eq!((a.product, a.y), (&steps[0].dst, &steps[1].dst));
                None
            }
            Fused::ProductAdd(p) => {
                assert_eq!(g.len, 2);
                assert_eq!((p.product, p.y), (&steps[0].dst, &steps[1].dst));
                assert_eq!((p.y.loc, p.y.nb), (p.r.loc, p.r.nb), "the add in place");
                None
            }
            Fused::RopeStore(s) => {
                // with the q and k norms: their 4 steps and q's rope
                match (s.q_norm, s.k_norm) {
                    (Some(_), Some(_)) => assert!((7..=8).contains(&g.len)),
                    (None, None) => assert!((2..=4).contains(&g.len)),
                    norms => panic!("one row norm of two: {norms:?}"),
                }
                assert_eq!(s.folded, folded_before);
                assert_eq!(plan.steps[s.k_write].dst, *s.k.1);
                None
            }
            Fused::MoeSum(m) => {
                assert_eq!(g.len, m.steps());
                let mul = match &m.route {
                    Some(r) => {
                        assert_eq!((r.logits, r.ids), (&steps[0].src[0], &steps[0].src[1]));
                        assert!(m.staged, "a routed sum stages the weights it makes");
                        &steps[2]
                    }
                    None => &steps[0],
                };
                assert_eq!((m.ys, m.w), (&mul.src[0], &mul.src[1]));
                assert_eq!(m.out, &steps[g.len - 1].dst);
                if let Some(r) = m.residual {
                    assert!(steps[g.len - 1].src.contains(r));
                }
                None
            }
            Fused::ExpertPair(p) => {
                assert_eq!(g.len, 2);
                assert!(std::ptr::eq(p.first, &steps[0]) && std::ptr::eq(p.second, &steps[1]));
                assert_eq!(p.first.src[1..], p.second.src[1..]);
                None
            }
            Fused::NormFold(f) => {
                assert_eq!(g.len, 5);
                assert_eq!((f.y, f.xn), (&steps[1].dst, &steps[3].dst));
                assert!(std::ptr::eq(f.next, &steps[4]));
                let then = groups.get(i + 1).map(|g| &g.fused);
                assert!(
                    matches!(then, Some(Fused::RopeStore(_)) | Some(Fused::SwiGlu(_))),
                    "a fold is applied by the next group"
                );
                None
            }
        };
        if folded_before {
            assert!(
                matches!(g.fused, Fused::RopeStore(_) | Fused::SwiGlu(_)),
                "group {i} after a fold"
            );
        }
        assert_eq!(
            q8,
            g.fused
                .q8()
                .filter(|_| !matches!(g.fused, Fused::Attention(_)))
        );
        if let Some(q8) = g.fused.q8() {
            let product = after.expect("a Q8_1 copy for a step after the group");
            assert_eq!(q8_1_input(product, target).as_ref(), Some(q8));
            assert_eq!(product.src[1], *q8.of);
        }
    }
    assert_eq!(next, plan.steps.len());
}

/// The groups of `plan` for `target`, checked ([`check_invariants`]).
fn fused<'p>(plan: &'p Plan, target: &Target) -> Vec<Group<'p>> {
    let groups = fuse(plan, target);
    check_invariants(plan, &groups, target);
    groups
}

/// A preset's decode (over 256 positions) or prefill (7 tokens after 3) plan with
/// weights `w` and caches `cache`.
fn model_plan(cfg: &Config, w: QuantPlan, cache: CacheTypes, decode: bool) -> Plan {
    let pick = |r, l| w.pick(r, l, cfg).dtype;
    let weights = Weights::layout(cfg, &pick, BufferId(1));
    let kv = KvCache::layout(cfg, 512, cache, BufferId(2));
    let g = match decode {
        true => build_decode(cfg, &weights, &kv, 256),
        false => build_prefill(cfg, &weights, &kv, 7, 3, false),
    };
    g.unwrap().plan().unwrap()
}

/// Every preset's decode and prefill plans, each weight type and cache kind: the groups
/// keep the invariants, for either target; without a target that reads Q8_1 nothing
/// writes a Q8_1 copy.
#[test]
fn every_preset_plan_keeps_the_invariants() {
    let caches = [
        CacheTypes::default(),
        CacheTypes {
            flash_attn: false,
            ..CacheTypes::default()
        },
        CacheTypes {
            k: DType::Q8_0,
            v: DType::Q8_0,
            flash_attn: true,
        },
    ];
    for name in presets::NAMES {
        let mut cfg = presets::preset(name).unwrap();
        cfg.num_hidden_layers = cfg.num_hidden_layers.min(3);
        for w in [
            QuantPlan::F16,
            QuantPlan::Q4_0,
            QuantPlan::Q4_K_M,
            QuantPlan::F32,
        ] {
            for cache in caches {
                for decode in [true, false] {
                    let plan = model_plan(&cfg, w, cache, decode);
                    for target in [Q8_1, F32_ACTS, BATCHED] {
                        let groups = fused(&plan, &target);
                        if decode {
                            assert!(groups.len() < plan.steps.len(), "{name}: something fuses");
                        }
                        if !target.q8_1 {
                            assert_eq!(count(&groups, "attention"), 0);
                        }
                    }
                    let groups = unfused(&plan);
                    check_invariants(&plan, &groups, &Q8_1);
                    assert_eq!(groups.len(), plan.steps.len());
                }
            }
        }
    }
}

/// A Llama-style decode step with F16 weights and flash attention (Llama 2, Llama 3 with
/// GQA, Mistral with a ring cache): the first layer's attention norm and the final norm
/// are fused norms; every other norm is folded into the products around it, its factor
/// applied by the next layer's `rope_store` or the layer's SwiGLU; the last layer's down
/// product keeps its add, as there is no norm to fold after it but the final one, whose
/// product is the head.
#[test]
fn float_llama_decode_folds_every_norm_between_products() {
    for name in ["tiny", "llama2-7b", "llama3-8b", "mistral-7b"] {
        let cfg = presets::preset(name).unwrap();
        let l = cfg.num_hidden_layers;
        let plan = model_plan(&cfg, QuantPlan::F16, CacheTypes::default(), true);
        let groups = fused(&plan, &Q8_1);
        let mut want = vec!["rms_norm_mul", "rope_store", "norm_fold", "swiglu"];
        for _ in 1..l {
            want.extend(["norm_fold", "rope_store", "norm_fold", "swiglu"]);
        }
        want.extend(["gemv_add", "rms_norm_mul"]);
        assert_eq!(fused_kinds(&groups), want, "{name}");
        let folded = groups.iter().filter(|g| g.fused.folded()).count();
        assert_eq!(folded, 2 * l - 1, "{name}");
        // each layer's rope_store covers q, k and v
        for g in &groups {
            if let Fused::RopeStore(s) = &g.fused {
                assert!(s.q.is_some() && s.v.is_some(), "{name}");
                assert_eq!(g.len, 4);
            }
        }
    }
}

/// A Llama decode step with Q4_0 weights: no norm folds (quantized products), every norm
/// and SwiGLU writes the Q8_1 copy its product reads, and with flash attention the
/// attention writes the o product's; with a target whose products read F32 activations,
/// none does.
#[test]
fn quantized_llama_decode_writes_q8_1_copies() {
    let cfg = presets::preset("llama2-7b").unwrap();
    let l = cfg.num_hidden_layers;
    for flash_attn in [true, false] {
        let cache = CacheTypes {
            flash_attn,
            ..CacheTypes::default()
        };
        let plan = model_plan(&cfg, QuantPlan::Q4_0, cache, true);
        let groups = fused(&plan, &Q8_1);
        assert_eq!(count(&groups, "norm_fold"), 0);
        assert_eq!(count(&groups, "rms_norm_mul"), 2 * l + 1);
        assert_eq!(count(&groups, "swiglu"), l);
        assert_eq!(count(&groups, "gemv_add"), 2 * l);
        assert_eq!(count(&groups, "rope_store"), l);
        assert_eq!(count(&groups, "attention"), if flash_attn { l } else { 0 });
        let copies = groups.iter().filter(|g| g.fused.q8().is_some()).count();
        assert_eq!(copies, 3 * l + 1 + if flash_attn { l } else { 0 });
        let groups = fused(&plan, &F32_ACTS);
        assert!(groups.iter().all(|g| g.fused.q8().is_none()));
    }
}

/// Q8_1 copies take the layout of the weights that read them: with Q4_K_M every product
/// that reads a copy has K-quant weights, whose lanes read pairs of blocks.
#[test]
fn q8_1_copies_take_the_layout_of_their_product() {
    let cfg = presets::preset("llama2-7b").unwrap();
    let plan = model_plan(&cfg, QuantPlan::Q4_K_M, CacheTypes::default(), true);
    let groups = fused(&plan, &Q8_1);
    let layouts: Vec<Q8Layout> = groups
        .iter()
        .filter_map(|g| g.fused.q8().map(|q| q.layout))
        .collect();
    assert!(!layouts.is_empty());
    assert!(layouts.iter().all(|l| *l == Q8Layout::Pairs), "{layouts:?}");
    assert_eq!(Q8Layout::of(DType::Quant(QType::Q4_0)), Q8Layout::Blocks);
    assert_eq!(Q8Layout::of(DType::Quant(QType::Q6_K)), Q8Layout::Pairs);
}

/// The attention inputs of a decode step: a Q8_0 cache has no `rope_store` (the ropes and
/// cache writes stay steps); a Q8_0 V cache with an F16 K cache keeps V's write out of it;
/// a model whose heads are normalized after the product (Qwen3) still fuses them, with
/// the q and k norms inside the launch where q and k come from one product; a Llama has
/// no row norms.
#[test]
fn rope_store_follows_the_cache_types() {
    let cfg = presets::preset("tiny").unwrap();
    let l = cfg.num_hidden_layers;
    let q8 = CacheTypes {
        k: DType::Q8_0,
        v: DType::Q8_0,
        flash_attn: true,
    };
    let plan = model_plan(&cfg, QuantPlan::F16, q8, true);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(count(&groups, "rope_store"), 0);
    let ropes = plan
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Rope(_)))
        .count();
    assert_eq!(ropes, 2 * l);
    let v8 = CacheTypes {
        v: DType::Q8_0,
        ..CacheTypes::default()
    };
    let plan = model_plan(&cfg, QuantPlan::F16, v8, true);
    let groups = fused(&plan, &Q8_1);
    let stores: Vec<&Group> = groups.iter().filter(|g| kind(g) == "rope_store").collect();
    assert_eq!(stores.len(), l);
    for g in stores {
        let Fused::RopeStore(s) = &g.fused else {
            unreachable!()
        };
        assert!(s.q.is_some() && s.v.is_none());
        assert_eq!(s.k.1.dtype, DType::F16);
    }
    let norms = |plan: &Plan| -> Vec<(bool, bool, bool)> {
        let groups = fused(plan, &Q8_1);
        let mut kinds = Vec::new();
        for g in &groups {
            if let Fused::RopeStore(s) = &g.fused {
                kinds.push((s.q.is_some(), s.q_norm.is_some(), s.k_norm.is_some()));
            }
        }
        kinds
    };
    let plan = model_plan(&cfg, QuantPlan::F16, CacheTypes::default(), true);
    assert_eq!(norms(&plan), vec![(true, false, false); l]);
    let mut qwen = presets::preset("qwen3-8b").unwrap();
    qwen.num_hidden_layers = 3;
    let plan = model_plan(&qwen, QuantPlan::F16, CacheTypes::default(), true);
    assert_eq!(norms(&plan), vec![(true, true, true); 3]);
    // Q4_K_M gives some layers' v more bits: q, k and v are then products of their own,
    // k's between q's rope and k's norm, and those layers keep q's norm and rope apart
    let plan = model_plan(&qwen, QuantPlan::Q4_K_M, CacheTypes::default(), true);
    let kinds = norms(&plan);
    assert!(kinds.contains(&(true, true, true)), "{kinds:?}");
    assert!(
        kinds
            .iter()
            .all(|k| [(true, true, true), (false, false, false)].contains(k)),
        "{kinds:?}"
    );
}

/// The plan of a graph made by `f`, for the outputs it returns.
fn plan_of(f: impl FnOnce(&mut Graph) -> Vec<TensorId>) -> Plan {
    let mut g = Graph::new();
    let outs = f(&mut g);
    g.plan(&outs).unwrap()
}

/// `rms_norm(x) * w` then a product of it: fused with the product's Q8_1 copy for
/// quantized weights of whole blocks, without it for float weights; not fused when the
/// norm has another reader, the weight is not one row, or the rows are F16.
#[test]
fn rms_norm_mul_pattern() {
    let norm_then = |wdt: DType, xdt: DType, rows: usize| {
        plan_of(|g| {
            let d = 256;
            let x0 = g.input("x0", xdt, &[d, rows]).unwrap();
            let x = g.scale(x0, 0.5).unwrap();
            let w = g.input("w", xdt, &[d, rows]).unwrap();
            let n = g.rms_norm(x, 1e-5).unwrap();
            let y = g.mul(n, w).unwrap();
            let wm = g.input("wm", wdt, &[d, 16]).unwrap();
            match xdt == DType::F32 {
                true => vec![g.mul_mat(wm, y).unwrap()],
                false => vec![y],
            }
        })
    };
    let q4 = DType::Quant(QType::Q4_0);
    let plan = norm_then(q4, DType::F32, 1);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["rms_norm_mul"]);
    let norm_q8 = |groups: &[Group]| match groups
        .iter()
        .map(|g| &g.fused)
        .find(|f| matches!(f, Fused::RmsNormMul(_)))
    {
        Some(Fused::RmsNormMul(n)) => n.q8.map(|q| q.layout),
        other => panic!("{other:?}"),
    };
    assert_eq!(norm_q8(&groups), Some(Q8Layout::Blocks));
    assert_eq!(norm_q8(&fused(&plan, &F32_ACTS)), None);
    let plan = norm_then(DType::Quant(QType::Q5_K), DType::F32, 1);
    assert_eq!(norm_q8(&fused(&plan, &Q8_1)), Some(Q8Layout::Pairs));
    let plan = norm_then(DType::F16, DType::F32, 1);
    assert_eq!(
        norm_q8(&fused(&plan, &Q8_1)),
        None,
        "a float product reads F32"
    );
    // broken: a weight of two rows; F16 rows
    for plan in [norm_then(q4, DType::F32, 2), norm_then(q4, DType::F16, 1)] {
        let groups = fused(&plan, &Q8_1);
        assert!(
            !fused_kinds(&groups).contains(&"rms_norm_mul"),
            "{:?}",
            fused_kinds(&groups)
        );
    }
    // broken: the norm also an output
    let plan = plan_of(|g| {
        let x0 = g.input("x0", DType::F32, &[64, 1]).unwrap();
        let x = g.scale(x0, 0.5).unwrap();
        let w = g.input("w", DType::F32, &[64]).unwrap();
        let n = g.rms_norm(x, 1e-5).unwrap();
        vec![g.mul(n, w).unwrap(), n]
    });
    let groups = fused(&plan, &Q8_1);
    assert!(
        fused_kinds(&groups).is_empty(),
        "{:?}",
        fused_kinds(&groups)
    );
}

/// A fused norm writes the Q8_1 activations of the product after it when the target reads
/// them at its width: decode widths on [`Target::q8_1`] (or from [`Target::batched_from`]
/// columns, where the batched product takes them), the other widths of one weight matrix
/// up to [`Target::batched_cols`] columns (batches of activations counted), and not past
/// them, nor for a batch of weight matrices.
#[test]
fn batched_products_take_q8_1_copies() {
    let norm_then = |shape: [usize; 3], wm_batch: usize| {
        plan_of(|g| {
            let d = 256;
            let x0 = g.input("x0", DType::F32, &[d, shape[0], shape[1], shape[2]]);
            let x = g.scale(x0.unwrap(), 0.5).unwrap();
            let w = g.input("w", DType::F32, &[d]).unwrap();
            let n = g.rms_norm(x, 1e-5).unwrap();
            let y = g.mul(n, w).unwrap();
            let wm = g.input("wm", DType::Quant(QType::Q4_K), &[d, 16, wm_batch]);
            vec![g.mul_mat(wm.unwrap(), y).unwrap()]
        })
    };
    let writes = |plan: &Plan, target: &Target| {
        let groups = fused(plan, target);
        assert_eq!(fused_kinds(&groups), ["rms_norm_mul"]);
        groups.iter().any(|g| g.fused.q8().is_some())
    };
    let no_mmvq = Target {
        q8_1: false,
        ..BATCHED
    };
    for (shape, wm_batch, q8_1, batched, dequantizing) in [
        ([1, 1, 1], 1, true, true, false),
        ([4, 1, 1], 1, true, true, false),
        ([8, 1, 1], 1, true, true, true),
        ([9, 1, 1], 1, false, true, true),
        ([64, 1, 1], 1, false, true, true),
        ([65, 1, 1], 1, false, false, false),
        ([4, 2, 1], 1, false, true, true),
        ([8, 4, 2], 1, false, true, true),
        ([8, 4, 3], 1, false, false, false),
        ([4, 2, 1], 2, false, false, false),
    ] {
        let plan = norm_then(shape, wm_batch);
        let what = format!("{shape:?} by {wm_batch} weight matrices");
        assert_eq!(writes(&plan, &Q8_1), q8_1, "{what}");
        assert_eq!(writes(&plan, &BATCHED), batched, "{what}");
        assert_eq!(
            writes(&plan, &no_mmvq),
            dequantizing,
            "{what}: decode products dequantize"
        );
        assert!(!writes(&plan, &F32_ACTS), "{what}");
    }
}

/// A target like the CUDA backend's with `mmr_*`: the 256-element types' batched products
/// read Q8_1 up to 15 columns, the 32-element types' none (F16 tensor cores from 5), every
/// tensor-core product up to 64 columns, and the rest read F16 copies: a fused norm writes
/// the copy its product reads, by weight type and width.
#[test]
fn f16_copies_follow_the_product_paths() {
    let cuda = Target {
        batched_cols: 15,
        batched_cols_32: 4,
        f16_copies: true,
        ..BATCHED
    };
    let norm_then = |wdt: DType, shape: [usize; 2]| {
        plan_of(|g| {
            let d = 256;
            let x0 = g.input("x0", DType::F32, &[d, shape[0], shape[1]]).unwrap();
            let x = g.scale(x0, 0.5).unwrap();
            let w = g.input("w", DType::F32, &[d]).unwrap();
            let n = g.rms_norm(x, 1e-5).unwrap();
            let y = g.mul(n, w).unwrap();
            let wm = g.input("wm", wdt, &[d, 16]).unwrap();
            vec![g.mul_mat(wm, y).unwrap()]
        })
    };
    let (q4_0, q4_k) = (DType::Quant(QType::Q4_0), DType::Quant(QType::Q4_K));
    let (blocks, pairs, f16) = (
        Some(Q8Layout::Blocks),
        Some(Q8Layout::Pairs),
        Some(Q8Layout::F16),
    );
    for (wdt, shape, want) in [
        (q4_0, [4, 1], blocks),
        (q4_0, [5, 1], f16),
        (q4_0, [64, 1], f16),
        (q4_0, [65, 1], None),
        (q4_k, [8, 1], pairs),
        (q4_k, [15, 1], pairs),
        (q4_k, [16, 1], f16),
        (q4_k, [4, 2], pairs),
        (q4_k, [8, 2], f16),
        (DType::Quant(QType::IQ4_XS), [8, 1], pairs),
        (DType::Quant(QType::IQ4_XS), [16, 1], None),
        (DType::F16, [1, 1], None),
        (DType::F16, [2, 1], f16),
        (DType::F16, [512, 1], f16),
        (DType::F16, [8, 2], f16),
        (DType::BF16, [8, 1], None),
        (DType::F32, [8, 1], None),
    ] {
        let plan = norm_then(wdt, shape);
        let groups = fused(&plan, &cuda);
        let layout = groups.iter().find_map(|g| {
            let Fused::RmsNormMul(n) = &g.fused else {
                return None;
            };
            Some(n.q8.map(|q| q.layout))
        });
        assert_eq!(layout, Some(want), "{wdt} by {shape:?}");
    }
}

/// A decode FFN on `x` (residual `r`): the gate|up product (`wgu` weights), SwiGLU over
/// views of its result, the down product (`wd` weights) and the residual add; also the
/// silu and the gate|up product's result as outputs when `outputs`.
fn ffn(
    g: &mut Graph,
    x: TensorId,
    r: TensorId,
    wgu: DType,
    wd: DType,
    outputs: bool,
) -> Vec<TensorId> {
    let (d, ff) = (64, 32);
    let wgu = g.input("wgu", wgu, &[d, 2 * ff]).unwrap();
    let wd = g.input("wd", wd, &[ff, d]).unwrap();
    let gu = g.mul_mat(wgu, x).unwrap();
    let (row, cols) = (g.tensor(gu).nb[1], g.tensor(gu).ne[1]);
    let gate = g.view_2d(gu, ff, cols, row, 0).unwrap();
    let up = g.view_2d(gu, ff, cols, row, ff * 4).unwrap();
    let s = g.silu(gate).unwrap();
    let h = g.mul(s, up).unwrap();
    let dn = g.mul_mat(wd, h).unwrap();
    let y = g.add(dn, r).unwrap();
    match outputs {
        true => vec![y, s, gu],
        false => vec![y],
    }
}

/// SwiGLU and the product after it with its residual add: fused, with the Q8_1 copy for
/// quantized down weights; Q8_1 weights (no decode kernels) keep the product and its add
/// apart; SwiGLU is not fused when silu has another reader.
#[test]
fn swiglu_and_gemv_add_patterns() {
    let q4 = DType::Quant(QType::Q4_0);
    let with = |wd: DType, outputs: bool| {
        plan_of(|g| {
            let x0 = g.input("x0", DType::F32, &[64, 1]).unwrap();
            let x = g.scale(x0, 0.5).unwrap();
            ffn(g, x, x, DType::F16, wd, outputs)
        })
    };
    let plan = with(q4, false);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["swiglu", "gemv_add"]);
    match groups
        .iter()
        .map(|g| &g.fused)
        .find(|f| matches!(f, Fused::SwiGlu(_)))
    {
        Some(Fused::SwiGlu(s)) => assert!(s.q8.is_some() && !s.folded),
        other => panic!("{other:?}"),
    }
    let plan = with(DType::Quant(QType::Q8_1), false);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["swiglu"]);
    let plan = with(DType::F16, true);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["gemv_add"]);
}

/// A product and its residual add fuse as a decode product's for a decode layout only
/// (two columns of float weights: a [`Fused::ProductAdd`], the add in place over the
/// residual); not for a residual with strided elements or of another dtype, or a result
/// the allocator placed where the product's input vector was (the fused launch would
/// overwrite it while it is read).
#[test]
fn gemv_add_pattern() {
    #[derive(Clone, Copy)]
    enum R {
        Dense,
        Strided,
        F16,
    }
    let product_add = |cols: usize, r: R| {
        plan_of(|g| {
            let v0 = g.input("v0", DType::F32, &[64, cols]).unwrap();
            let v = g.scale(v0, 0.5).unwrap();
            let w = g.input("w", DType::F16, &[64, 64]).unwrap();
            let o = g.mul_mat(w, v).unwrap();
            let r = match r {
                R::Dense => {
                    let x0 = g.input("x0", DType::F32, &[64, cols]).unwrap();
                    g.scale(x0, 2.0).unwrap()
                }
                R::Strided => {
                    let x0 = g.input("x0", DType::F32, &[2, 64]).unwrap();
                    let x = g.scale(x0, 2.0).unwrap();
                    let col = g.view_2d(x, 1, 64, 8, 0).unwrap();
                    g.transpose(col).unwrap()
                }
                R::F16 => {
                    let x0 = g.input("x0", DType::F16, &[64, cols]).unwrap();
                    g.scale(x0, 2.0).unwrap()
                }
            };
            vec![g.add(r, o).unwrap()]
        })
    };
    let plan = product_add(1, R::Dense);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["gemv_add"]);
    let plan = product_add(2, R::Dense);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["product_add"]);
    for plan in [product_add(1, R::Strided), product_add(1, R::F16)] {
        let groups = fused(&plan, &Q8_1);
        assert!(
            fused_kinds(&groups).is_empty(),
            "{:?}",
            fused_kinds(&groups)
        );
    }
    // The add's result lands in the block the product's input vector had.
    let plan = plan_of(|g| {
        let x = g.input("x", DType::F32, &[64, 1]).unwrap();
        let v0 = g.input("v0", DType::F32, &[64, 1]).unwrap();
        let w = g.input("w", DType::F16, &[64, 64]).unwrap();
        let v = g.scale(v0, 0.5).unwrap();
        let o = g.mul_mat(w, v).unwrap();
        vec![g.add(x, o).unwrap()]
    });
    let find = |op: &str| plan.steps.iter().find(|s| s.op.name() == op).unwrap();
    assert_eq!(
        find("add").dst.loc,
        find("mul_mat").src[1].loc,
        "the allocator reuses the vector's block (the case this checks)"
    );
    let groups = fused(&plan, &Q8_1);
    assert!(fused_kinds(&groups).is_empty());
}

/// A quantized product and its residual add fuse at the decode kernels' widths, and from
/// [`Target::batched_from`] columns on, where the batched product takes the product, as a
/// [`Fused::ProductAdd`] (the add in place over the residual).
#[test]
fn gemv_add_leaves_batched_widths() {
    let product_add = |cols: usize| {
        plan_of(|g| {
            let v0 = g.input("v0", DType::F32, &[64, cols]).unwrap();
            let v = g.scale(v0, 0.5).unwrap();
            let w = g.input("w", DType::Quant(QType::Q4_0), &[64, 64]).unwrap();
            let o = g.mul_mat(w, v).unwrap();
            let x0 = g.input("x0", DType::F32, &[64, cols]).unwrap();
            let r = g.scale(x0, 2.0).unwrap();
            vec![g.add(r, o).unwrap()]
        })
    };
    for (cols, target, want) in [
        (4, BATCHED, vec!["gemv_add"]),
        (5, BATCHED, vec!["product_add"]),
        (8, BATCHED, vec!["product_add"]),
        (8, Q8_1, vec!["gemv_add"]),
        (64, Q8_1, vec!["product_add"]),
    ] {
        let plan = product_add(cols);
        let groups = fused(&plan, &target);
        assert_eq!(fused_kinds(&groups), want, "{cols} columns");
    }
}

/// A product of columns and its residual add fuse only where the add's result is the
/// residual's memory (the launches add the residual where they write): not where the
/// residual is read again later (the add cannot run in place over it) or is a graph input.
#[test]
fn product_add_needs_the_add_in_place() {
    #[derive(Clone, Copy, Debug)]
    enum R {
        Dies,
        ReadLater,
        Input,
    }
    for (dtype, r) in [
        (DType::F16, R::Dies),
        (DType::F16, R::ReadLater),
        (DType::F16, R::Input),
        (DType::Quant(QType::Q4_0), R::Dies),
        (DType::Quant(QType::Q4_0), R::ReadLater),
    ] {
        let plan = plan_of(|g| {
            let v0 = g.input("v0", DType::F32, &[64, 16]).unwrap();
            let v = g.scale(v0, 0.5).unwrap();
            let w = g.input("w", dtype, &[64, 64]).unwrap();
            let o = g.mul_mat(w, v).unwrap();
            let x0 = g.input("x0", DType::F32, &[64, 16]).unwrap();
            let x = match r {
                R::Input => x0,
                R::Dies | R::ReadLater => g.scale(x0, 2.0).unwrap(),
            };
            let y = g.add(x, o).unwrap();
            match r {
                R::ReadLater => vec![g.mul(y, x).unwrap()],
                R::Dies | R::Input => vec![y],
            }
        });
        let add = plan.steps.iter().find(|s| s.op.name() == "add").unwrap();
        let in_place = add.dst.loc == add.src[0].loc;
        assert_eq!(
            in_place,
            matches!(r, R::Dies),
            "{dtype} {r:?}: the allocator's choice"
        );
        let groups = fused(&plan, &Q8_1);
        let want: &[&str] = match r {
            R::Dies => &["product_add"],
            R::ReadLater | R::Input => &[],
        };
        assert_eq!(fused_kinds(&groups), want, "{dtype} {r:?}");
        check_invariants(&plan, &groups, &Q8_1);
    }
}

/// A decode FFN block whose norm folds: `o + add`, the norm and the gate|up product
/// become one [`Fused::NormFold`] and the SwiGLU after it applies the factor. No fold when
/// the gate|up product's result has another reader (the SwiGLU would not read every use),
/// with quantized products, or with two columns.
#[test]
fn norm_fold_pattern() {
    let fold = |wo: DType, cols: usize, outputs: bool| {
        plan_of(|g| {
            let d = 64;
            let x0 = g.input("x0", DType::F32, &[d, cols]).unwrap();
            let v0 = g.input("v0", DType::F32, &[d, cols]).unwrap();
            let x = g.scale(x0, 4.0).unwrap();
            let v = g.scale(v0, 0.5).unwrap();
            let wo = g.input("wo", wo, &[d, d]).unwrap();
            let wn = g.input("wn", DType::F32, &[d]).unwrap();
            let o = g.mul_mat(wo, v).unwrap();
            let x1 = g.add(x, o).unwrap();
            let n = g.rms_norm(x1, 1e-5).unwrap();
            let cur = g.mul(n, wn).unwrap();
            ffn(g, cur, x1, DType::F32, DType::F16, outputs)
        })
    };
    let plan = fold(DType::F16, 1, false);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(fused_kinds(&groups), ["norm_fold", "swiglu", "gemv_add"]);
    match groups
        .iter()
        .map(|g| &g.fused)
        .find(|f| matches!(f, Fused::SwiGlu(_)))
    {
        Some(Fused::SwiGlu(s)) => assert!(s.folded),
        other => panic!("{other:?}"),
    }
    let plan = fold(DType::F16, 1, true);
    let groups = fused(&plan, &Q8_1);
    assert_eq!(
        fused_kinds(&groups),
        ["gemv_add", "rms_norm_mul", "gemv_add"]
    );
    for plan in [
        fold(DType::Quant(QType::Q4_0), 1, false),
        fold(DType::F16, 2, false),
    ] {
        let groups = fused(&plan, &Q8_1);
        assert_eq!(count(&groups, "norm_fold"), 0, "{:?}", fused_kinds(&groups));
    }
}

/// A mixture of experts' block ends in one weighted sum a layer: each MoE preset's decode
/// and prefill (7 tokens) plans, every weight type, fuse the routing weights' get_rows and
/// soft_max, the mul by them, the adds of all `n_used` expert slots and the residual add
/// into one staged launch. A target that stages fewer weights than the step has fuses no
/// routing, nor a sum that would need staging.
#[test]
fn moe_presets_fuse_the_weighted_sum() {
    for name in ["tiny-moe", "qwen3-30b-a3b"] {
        let mut cfg = presets::preset(name).unwrap();
        cfg.num_hidden_layers = cfg.num_hidden_layers.min(3);
        let n_used = cfg.moe.unwrap().n_used;
        for w in [QuantPlan::F16, QuantPlan::Q4_K_M] {
            for (decode, n) in [(true, 1), (false, 7)] {
                let plan = model_plan(&cfg, w, CacheTypes::default(), decode);
                // (routed, with its residual, staged) of each fused sum
                let sums = |target: &Target| {
                    let groups = fused(&plan, target);
                    let mut kinds = Vec::new();
                    for g in &groups {
                        if let Fused::MoeSum(s) = &g.fused {
                            if s.route.is_none() {
                                assert_eq!(s.staged, !disjoint(s.out, s.w), "{name}");
                            }
                            kinds.push((s.route.is_some(), s.residual.is_some(), s.staged));
                        }
                    }
                    kinds
                };
                let all = vec![(true, true, true); cfg.num_hidden_layers];
                // up and gate in one launch where the decode kernels take block-quantized
                // experts (not F16 ones, not a prefill)
                let pairs = count(&fused(&plan, &Q8_1), "expert_pair");
                let quantized = w == QuantPlan::Q4_K_M && decode;
                assert_eq!(
                    pairs,
                    usize::from(quantized) * cfg.num_hidden_layers,
                    "{name}"
                );
                assert_eq!(count(&fused(&plan, &F32_ACTS), "expert_pair"), 0, "{name}");
                assert_eq!(sums(&Q8_1), all, "{name} {decode}");
                assert_eq!(sums(&BATCHED), all, "{name} {decode}");
                let short = Target {
                    moe_sum_stage: n_used * n - 1,
                    ..Q8_1
                };
                for target in [short, F32_ACTS] {
                    let kinds = sums(&target);
                    assert!(
                        kinds.iter().all(|&(routed, _, staged)| !routed && !staged),
                        "{name} {decode}: {kinds:?}"
                    );
                }
            }
        }
    }
}

/// How [`moe_tail`] builds the weighted sum of `n_used` expert slots.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tail {
    /// As the model does: `((y0 + y1) + y2) + ...`.
    Model,
    /// Each add with the slot first: `y2 + (y1 + y0)`, the same f32 sums.
    SlotFirst,
    /// The mul's result is an output too.
    ProductOut,
    /// The first partial sum is an output too.
    PartialOut,
    /// Slot 1's view is an output too.
    SlotOut,
    /// Slot 0's view starts one element in.
    SlotOffset,
    /// The slots' views take rows `nb[1]` apart (other elements).
    SlotStride,
    /// Slots 1 and 2 added in the other order.
    Reordered,
    /// `y0 + (y1 + y2)`.
    RightFirst,
    /// The last slot left out of the sum.
    Short,
    /// F16 outputs and weights.
    F16,
    /// F16 weights.
    F16Weights,
    /// One weight a token for every slot, `[1, 1, n]`.
    SharedWeights,
    /// A weight an element, `[d, n_used, n]`.
    FullWeights,
}

/// A mixture of experts' tail over `n` tokens (64 wide): outputs computed from an input
/// (as mul_mat_id's), weighted by `w` and summed over the `n_used` slots as `how` says;
/// the outputs of the plan.
fn moe_tail(g: &mut Graph, n_used: usize, n: usize, how: Tail) -> Vec<TensorId> {
    let d = 64;
    let dt = if how == Tail::F16 {
        DType::F16
    } else {
        DType::F32
    };
    let wdt = if matches!(how, Tail::F16 | Tail::F16Weights) {
        DType::F16
    } else {
        DType::F32
    };
    let wshape = if how == Tail::SharedWeights {
        [1, 1, n]
    } else if how == Tail::FullWeights {
        [d, n_used, n]
    } else {
        [1, n_used, n]
    };
    let ys0 = g.input("ys0", dt, &[d, n_used, n]).unwrap();
    let ys = g.scale(ys0, 0.5).unwrap();
    let w = g.input("w", wdt, &wshape).unwrap();
    let y = g.mul(ys, w).unwrap();
    let nb = g.tensor(y).nb;
    let slot = |g: &mut Graph, i: usize| {
        let row = if how == Tail::SlotStride {
            nb[1]
        } else {
            nb[2]
        };
        let shift = if how == Tail::SlotOffset && i == 0 {
            4
        } else {
            0
        };
        g.view_2d(y, d, n, row, i * nb[1] + shift).unwrap()
    };
    let mut order: Vec<usize> = (0..n_used).collect();
    if how == Tail::Reordered {
        order.swap(1, 2);
    }
    if how == Tail::Short {
        order.pop();
    }
    let mut outs = Vec::new();
    let mut sum = slot(g, order[0]);
    if how == Tail::RightFirst {
        let (a, b) = (slot(g, 1), slot(g, 2));
        let right = g.add(a, b).unwrap();
        sum = g.add(sum, right).unwrap();
        order.retain(|&i| i == 0 || i > 2);
    }
    for (k, &i) in order.iter().enumerate().skip(1) {
        let yi = slot(g, i);
        sum = if how == Tail::SlotFirst {
            g.add(yi, sum).unwrap()
        } else {
            g.add(sum, yi).unwrap()
        };
        if how == Tail::PartialOut && k == 1 {
            outs.push(sum);
        }
    }
    outs.insert(0, sum);
    if how == Tail::ProductOut {
        outs.push(y);
    }
    if how == Tail::SlotOut {
        outs.push(slot(g, 1));
    }
    outs
}

/// The mul by the broadcast routing weights and the adds of every expert slot in slot
/// order fuse (either operand of an add first), for 2 to 8 slots and 1 to many tokens;
/// one slot has no adds. Nothing fuses when the product, a partial sum or a slot has
/// another reader, a slot's view has another offset or stride, the slots are added in
/// another order or grouping or not all of them, the outputs or weights are F16, or the
/// weights are broadcast otherwise.
#[test]
fn moe_sum_pattern() {
    let kinds = |n_used: usize, n: usize, how: Tail| {
        let plan = plan_of(|g| moe_tail(g, n_used, n, how));
        let groups = fused(&plan, &Q8_1);
        let sums: Vec<usize> = groups
            .iter()
            .filter(|g| kind(g) == "moe_sum")
            .map(|g| g.len)
            .collect();
        (fused_kinds(&groups), sums)
    };
    for (n_used, n) in [(2, 1), (3, 1), (8, 1), (8, 7), (4, 64)] {
        for how in [Tail::Model, Tail::SlotFirst] {
            let (k, sums) = kinds(n_used, n, how);
            assert_eq!(
                (k, sums),
                (vec!["moe_sum"], vec![n_used]),
                "{n_used} {n} {how:?}"
            );
        }
    }
    assert!(kinds(1, 4, Tail::Model).0.is_empty());
    for how in [
        Tail::ProductOut,
        Tail::PartialOut,
        Tail::SlotOut,
        Tail::SlotOffset,
        Tail::SlotStride,
        Tail::Reordered,
        Tail::RightFirst,
        Tail::Short,
        Tail::F16,
        Tail::F16Weights,
        Tail::SharedWeights,
        Tail::FullWeights,
    ] {
        assert!(kinds(3, 2, how).0.is_empty(), "{how:?}");
    }
}

/// The outputs are a permuted view of a result nothing reads after the mul (so the mul
/// does not run in place): the allocator gives the first partial sum, and so the sum,
/// that result's memory, which the fused launch would overwrite while it reads it; with
/// that result also an output it keeps its memory and the sum fuses.
#[test]
fn moe_sum_refuses_a_sum_over_its_outputs() {
    let (d, n_used, n) = (64, 4, 3);
    let tail = |keep: bool| {
        plan_of(|g| {
            let ys0 = g.input("ys0", DType::F32, &[d, n, n_used]).unwrap();
            let raw = g.scale(ys0, 0.5).unwrap();
            let ys = g.permute(raw, [0, 2, 1, 3]).unwrap();
            let w = g.input("w", DType::F32, &[1, n_used, n]).unwrap();
            let sum = weighted_sum(g, ys, w).unwrap();
            match keep {
                true => vec![sum, raw],
                false => vec![sum],
            }
        })
    };
    let plan = tail(false);
    let (mul, last) = (&plan.steps[1], plan.steps.last().unwrap());
    assert_eq!(mul.op.name(), "mul");
    assert!(
        !disjoint(&last.dst, &mul.src[0]),
        "the allocator reuses the outputs' block (the case this checks)"
    );
    assert!(fused_kinds(&fused(&plan, &Q8_1)).is_empty());
    let plan = tail(true);
    assert_eq!(fused_kinds(&fused(&plan, &Q8_1)), ["moe_sum"]);
}
