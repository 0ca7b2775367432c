//! The kernel table and fill_random. Without a GPU the device tests print "skipped: no
//! GPU" and pass, unless GRAFT_REQUIRE_GPU=1, which makes a missing GPU a failure.

use std::collections::HashSet;

use graft::backend::cpu::CpuBackend;
use graft::backend::cuda::kernels::{cols, k, KernelId, KeyedSets, ALL, MODULES};
use graft::backend::cuda::CudaBackend;
use graft::backend::Backend;
use graft::graph::DType;

fn gpu() -> Option<CudaBackend> {
    CudaBackend::new_or_skip(0).expect("GRAFT_REQUIRE_GPU=1 but the CUDA backend cannot start")
}

/// The generated table: every module has kernels, names are unique, indices dense, and
/// the kernels the backend dispatches to by name exist (a misspelt constant would not
/// compile; this checks the parse of the sources found them all).
#[test]
fn kernel_table_is_complete() {
    // One module per cuda/*.cu (read from the source tree, or from the working folder
    // when the test binary runs from a GPU bundle).
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let dir = if built.is_dir() { built } else { "cuda".into() };
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "cu").then(|| p.file_stem()?.to_str().map(String::from))?
        })
        .collect();
    files.sort();
    let mut modules: Vec<String> = MODULES.iter().map(|m| m.name.to_string()).collect();
    modules.sort();
    assert_eq!(modules, files, "one module per cuda/*.cu");
    let mut names = HashSet::new();
    for (i, kernel) in ALL.iter().enumerate() {
        assert_eq!(kernel.index, i);
        assert!(kernel.module < MODULES.len());
        assert!(names.insert(kernel.name), "{} listed twice", kernel.name);
    }
    for (m, module) in MODULES.iter().enumerate() {
        assert!(
            ALL.iter().any(|kernel| kernel.module == m),
            "{} has no kernel",
            module.name
        );
    }
    // The kernels compiled are the list of tests/fixtures/kernel_names.txt, which holds
    // every kernel of the tree when the instantiation tables of the decode products and
    // the attention were first generated (build/instances.rs): a kernel added or retired
    // on purpose is added to or removed from that list.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let listed = root.join("tests/fixtures/kernel_names.txt");
    let listed = if listed.is_file() {
        listed
    } else {
        "tests/fixtures/kernel_names.txt".into()
    };
    let want =
        std::fs::read_to_string(&listed).unwrap_or_else(|e| panic!("{}: {e}", listed.display()));
    let want: Vec<&str> = want.lines().collect();
    let mut got: Vec<&str> = ALL.iter().map(|k| k.name).collect();
    got.sort_unstable();
    let missing: Vec<&&str> = want.iter().filter(|n| !got.contains(n)).collect();
    let extra: Vec<&&str> = got.iter().filter(|n| !want.contains(n)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "kernels missing: {missing:?}; not in {}: {extra:?}",
        listed.display()
    );
    for kernel in [
        k::MUL_MAT_VEC_F16.id,
        k::MUL_MAT_P021_F16_F32.id,
        k::MUL_MAT_VEC_NC_F16_F32.id,
        k::RMS_NORM_BF16.id,
        k::SET_ROWS_F32_F16.id,
        k::FILL_RANDOM_BF16.id,
        k::QUANTIZE_Q8_1_F32.id,
        k::MUL_MAT_VEC_Q_C1_Q4_0.id,
        k::MUL_MAT_VEC_DQ_C8_Q6_K.id,
        k::CPY_F32_Q4_K.id,
        k::CPY_Q6_K_F16.id,
        k::GET_ROWS_Q8_0.id,
    ] {
        assert_eq!(ALL[kernel.index], kernel);
        assert!(MODULES[kernel.module].image.len() > 1000);
    }
}

/// Every kernel of every module loads (CudaBackend::new looks each one up) and answers
/// its attributes; the GEMV kernels (block-quantized decode products and the Q8_1
/// activation quantizer included) and the batched quantized products use no local memory
/// (no spills).
#[test]
fn every_kernel_loads() {
    let Some(be) = gpu() else { return };
    println!("{}", be.device_name());
    for kernel in ALL {
        let (regs, local) = be.kernel_resources(*kernel).unwrap();
        println!(
            "{:28} {:3} registers {:4} local bytes",
            kernel.name, regs, local
        );
        assert!(regs > 0, "{}", kernel.name);
    }
    for kernel in [
        k::MUL_MAT_VEC_F16.id,
        k::MUL_MAT_VEC_BF16.id,
        k::MUL_MAT_VEC_F32.id,
        k::MUL_MAT_VEC_NC_F16_F32.id,
        k::MUL_MAT_P021_F16_F32.id,
        k::FATTN_VEC_D128_F32.id,
        k::FATTN_VEC_D128_BF16.id,
        k::FATTN_VEC1_D128_BF16.id,
        k::FATTN_VEC1_D128_F16.id,
        k::FATTN_VEC_D128_Q8_0.id,
        k::FATTN_VEC_D128_Q4_0.id,
        k::FATTN_DEC_D128_F16.id,
        k::FATTN_DEC_D256_F16.id,
        k::FATTN_COMBINE.id,
        k::FATTN_MMA_D128_F16.id,
        k::FATTN_MMA_D128_BF16.id,
        k::FATTN_MMA_D64_F16.id,
        k::FATTN_PAGED_VEC_D128_F16.id,
        k::FATTN_PAGED_VEC_D128_Q8_0.id,
        k::FATTN_PAGED_VEC4_D128_Q8_0.id,
        k::FATTN_PAGED_VEC4_D128_Q4_0.id,
        k::FATTN_PAGED_DEC_D128_F16.id,
        k::FATTN_PAGED_ANY_D128.id,
        k::FATTN_PAGED_MMA_D64_F16.id,
        k::FATTN_PAGED_COMBINE.id,
    ]
    .into_iter()
    .chain(quantized_decode_kernels())
    .chain(batched_quantized_kernels())
    {
        assert_eq!(
            be.kernel_resources(kernel).unwrap().1,
            0,
            "{} spills",
            kernel.name
        );
    }
    // The split-row and in-place decode kernels: none spills but the two Q5_K one-column
    // kernels, whose 4-byte spill (an 8-byte frame) cuda/mul_mat_q.cu documents at every
    // block count it tried (6-8 an SM).
    for kernel in split_and_in_place_decode_kernels() {
        let local = be.kernel_resources(kernel).unwrap().1;
        let allowed = match kernel.name {
            "mul_mat_vec_qs_c1_q5_k" | "mul_mat_vec_qd_c1_q5_k" => 8,
            _ => 0,
        };
        assert!(
            local <= allowed,
            "{} spills: {local} local bytes",
            kernel.name
        );
    }
}

/// The streamed decode attention (flash_attn_ext's and paged_attn's) launches with at most
/// 4 blocks an SM (its grid is one wave of 4): the reservation that caps it leaves exactly
/// 4 where more fit without it.
#[test]
fn capped_attention_holds_four_blocks_per_sm() {
    let Some(be) = gpu() else { return };
    let streamed: Vec<_> = ALL
        .iter()
        .filter(|k| {
            ["fattn_vec1s_", "fattn_vec4s_", "fattn_paged_vec"]
                .iter()
                .any(|p| k.name.starts_with(p))
        })
        .collect();
    assert_eq!(
        streamed.len(),
        26 + 18,
        "vec1s: 8 head dims x F16, BF16, head dims 64, 128, 256 x Q8_0, Q4_0; vec4s: 128, 256; \
         paged vec: 64, 128, 256 x F16, BF16, Q8_0, Q4_0; paged vec4: 128, 256 x BF16, Q8_0, Q4_0"
    );
    for kernel in streamed {
        let free = be.blocks_per_sm(*kernel, 128, 0).unwrap();
        let capped = be.blocks_per_sm(*kernel, 128, 4).unwrap();
        println!("{:26} {free} blocks an SM, {capped} capped", kernel.name);
        assert!(free >= 4, "{}: {free} blocks an SM", kernel.name);
        assert_eq!(capped, 4, "{}", kernel.name);
    }
}

/// The hot kernels of decode with block-quantized weights: both decode paths for every
/// column count and weight type, and the activation quantizer.
fn quantized_decode_kernels() -> Vec<KernelId> {
    let mut v = kernels_of(&[cols::MUL_MAT_VEC_Q, cols::MUL_MAT_VEC_DQ]);
    assert_eq!(
        v.len(),
        168,
        "21 weight types (every block type but Q8_1) x 4 column counts x 2 paths"
    );
    v.push(k::QUANTIZE_Q8_1_F32.id);
    v
}

/// The decode kernels of frozen weights in split rows (`qs`, `qsp`, `dqs`) and of rows
/// read in place (`qd`), every type and column count.
fn split_and_in_place_decode_kernels() -> Vec<KernelId> {
    let v = kernels_of(&[
        cols::MUL_MAT_VEC_QS,
        cols::MUL_MAT_VEC_QSP,
        cols::MUL_MAT_VEC_DQS,
        cols::MUL_MAT_VEC_QD,
    ]);
    assert_eq!(
        v.len(),
        96,
        "7 split-row types x 4 column counts x 3 paths + 3 in-place types x 4"
    );
    v
}

/// The batched quantized products on tensor cores (`mmq_*`, `mmh_*`, `mmr_*`): every weight
/// type by every column tile in ggml's blocks, the split-row types in split rows, and the
/// sum of the parts of K.
fn batched_quantized_kernels() -> Vec<KernelId> {
    let mut v = kernels_of(&[
        cols::MMQ,
        cols::MMQ_SPLIT,
        cols::MMH,
        cols::MMH_SPLIT,
        cols::MMR,
        cols::MMR_SPLIT,
    ]);
    assert_eq!(
        v.len(),
        160,
        "(8 weight types + 7 split-row types) x 4 column tiles, int8 and F16, \
         + (5 + 5) 32-element types x 4 on F16 in registers"
    );
    v.push(k::MMQ_REDUCE.id);
    v
}

/// Every kernel of the keyed families `families`, every key.
fn kernels_of<A>(families: &[KeyedSets<A, 1>]) -> Vec<KernelId> {
    families
        .iter()
        .flat_map(|f| f.entries.iter())
        .flat_map(|(_, set)| set.entries.iter().map(|(_, k)| k.id))
        .collect()
}

/// fill_random on the GPU gives the CPU backend's bytes, bit for bit, for every float
/// dtype, at an offset, for several seeds, scales and lengths.
#[test]
fn fill_random_matches_cpu() {
    let Some(mut gpu) = gpu() else { return };
    let mut cpu = CpuBackend::new();
    for dtype in DType::FLOATS {
        for (n, seed, scale) in [
            (1usize, 0u64, 1.0f32),
            (1000, 7, 0.02),
            (100_003, 0x1234_5678_9abc, 3.5),
        ] {
            let es = dtype.block_bytes();
            let offset = 5 * es;
            let bytes = offset + n * es + 3 * es;
            let gb = gpu.alloc_buffer(bytes).unwrap();
            let cb = cpu.alloc_buffer(bytes).unwrap();
            gpu.fill_random(gb, offset, dtype, n, seed, scale).unwrap();
            cpu.fill_random(cb, offset, dtype, n, seed, scale).unwrap();
            let mut g = vec![0u8; bytes];
            let mut c = vec![0u8; bytes];
            gpu.read_buffer(gb, 0, &mut g).unwrap();
            cpu.read_buffer(cb, 0, &mut c).unwrap();
            let first_diff = g.iter().zip(&c).position(|(a, b)| a != b);
            assert_eq!(
                first_diff, None,
                "{dtype} n={n} seed={seed}: first differing byte"
            );
            // Guard bytes around the range stay zero; the range is not all zero.
            assert!(g[..offset].iter().all(|&b| b == 0));
            assert!(g[offset + n * es..].iter().all(|&b| b == 0));
            assert!(g[offset..offset + n * es].iter().any(|&b| b != 0));
            gpu.free_buffer(gb).unwrap();
        }
    }
    // Out of range and non-float requests are errors, not launches.
    let gb = gpu.alloc_buffer(16).unwrap();
    assert!(gpu.fill_random(gb, 0, DType::F32, 5, 1, 1.0).is_err());
    assert!(gpu.fill_random(gb, 0, DType::I32, 2, 1, 1.0).is_err());
    assert!(gpu.fill_random(gb, 2, DType::F32, 1, 1, 1.0).is_err());
}
