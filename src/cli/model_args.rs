//! The options of every command that loads a model ([`ModelArgs`]: which model, its
//! weight type, the context, the KV cache, the backend and the split over devices), and
//! the one place that turns them into a backend, [`LoadOptions`] and a [`Model`].

use std::path::{Path, PathBuf};

use clap::ValueEnum;

use graft::backend::cpu::CpuBackend;
use graft::backend::group::DeviceGroup;
use graft::backend::Backend;
use graft::graph::DType;
use graft::models::{pull, LoadOptions, Model, QuantPlan};
use graft::Result;

/// The model a command runs and where: shared by `generate`, `chat`, `logits`, `trace`
/// and `bench` (flattened into each), so that every option means the same everywhere.
#[derive(clap::Args, Clone, Debug)]
pub(super) struct ModelArgs {
    /// A `.gguf` file or a Hugging Face model folder (config.json, safetensors weights,
    /// tokenizer.json); default (but for bench, which needs --model or --preset): the
    /// default model, SmolLM2-135M-Instruct Q4_1, pulled into the cache on first use.
    #[arg(long = "model", id = "model", value_name = "MODEL")]
    pub location: Option<PathBuf>,
    /// Weight type: quantize (or convert) the matrices while loading, one type for all or
    /// ggml's q4_k_m / q5_k_m mixes (norms stay F32); default: the types the model stores
    /// (f16 for a preset's random weights).
    #[arg(long, value_enum, visible_alias = "dtype")]
    pub quantize: Option<DTypeArg>,
    /// KV-cache positions (default: max_position_embeddings, at most 4096; for `logits`
    /// and `trace` the number of tokens, for `bench` -p + -n).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    pub backend: BackendKind,
    /// Split the model over N devices (tensor parallelism: heads and the MLP divided,
    /// partial sums joined by all_reduce); on the CPU backend, N simulated devices.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    #[command(flatten)]
    pub cache: CacheArgs,
}

impl ModelArgs {
    /// The model's path: `--model`, or the default model (pulled first when missing).
    pub fn path(&self) -> Result<PathBuf> {
        model_path(self.location.clone())
    }

    /// The backend asked for, split over `--tp` devices.
    pub fn open_backend(&self) -> Result<Box<dyn Backend>> {
        make_backend(self.backend, self.tp)
    }

    /// The load options: `--ctx` (else `ctx`, else the model's default), `--quantize`, the
    /// cache types, and a progress bar unless `quiet`.
    pub fn options(&self, ctx: Option<usize>, quiet: bool) -> LoadOptions {
        LoadOptions {
            quantize: self.quantize.map(QuantPlan::from),
            ctx: self.ctx.or(ctx),
            progress: !quiet,
            cache: self.cache.types(),
        }
    }

    /// Loads the model at `path` on `be` with [`ModelArgs::options`], warning when the
    /// context exceeds what the model was trained for (graft allows it: nothing breaks,
    /// but the model has not seen such positions).
    pub fn load(
        &self,
        path: &Path,
        be: &mut dyn Backend,
        ctx: Option<usize>,
        quiet: bool,
    ) -> Result<Model> {
        let model = Model::load(path, be, &self.options(ctx, quiet))?;
        let (ctx, max) = (model.cache().ctx, model.config().max_position_embeddings);
        if ctx > max {
            eprintln!(
                "warning: a context of {ctx} positions (--ctx) exceeds the model's max_position_embeddings ({max}); output past position {max} may degrade"
            );
        }
        Ok(model)
    }

    /// The weight type of a preset's random weights: `--quantize`, else f16.
    pub fn plan(&self) -> QuantPlan {
        QuantPlan::from(self.quantize.unwrap_or(DTypeArg::F16))
    }
}

/// The model path: `path`, or the default model (pulled first when missing).
pub(super) fn model_path(path: Option<PathBuf>) -> Result<PathBuf> {
    match path {
        Some(p) => Ok(p),
        None => pull::default_model(),
    }
}

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum BackendKind {
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (GPU 0; needs a build with `--features cuda`).
    Cuda,
}

/// Weight dtypes accepted on the command line: one type for every matrix, or one of
/// ggml's mixes (see [`QuantPlan`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(super) enum DTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "q5_0")]
    Q5_0,
    #[value(name = "q5_1")]
    Q5_1,
    #[value(name = "q4_k")]
    Q4_K,
    #[value(name = "q5_k")]
    Q5_K,
    #[value(name = "q6_k")]
    Q6_K,
    #[value(name = "q4_k_m")]
    Q4_K_M,
    #[value(name = "q5_k_m")]
    Q5_K_M,
    #[value(name = "q2_k")]
    Q2_K,
    #[value(name = "q3_k_s")]
    Q3_K_S,
    #[value(name = "q3_k_m")]
    Q3_K_M,
    #[value(name = "q3_k_l")]
    Q3_K_L,
    #[value(name = "iq4_nl")]
    IQ4_NL,
    #[value(name = "iq4_xs")]
    IQ4_XS,
}

impl From<DTypeArg> for QuantPlan {
    fn from(d: DTypeArg) -> QuantPlan {
        match d {
            DTypeArg::F32 => QuantPlan::F32,
            DTypeArg::F16 => QuantPlan::F16,
            DTypeArg::Bf16 => QuantPlan::BF16,
            DTypeArg::Q8_0 => QuantPlan::Q8_0,
            DTypeArg::Q4_0 => QuantPlan::Q4_0,
            DTypeArg::Q4_1 => QuantPlan::Q4_1,
            DTypeArg::Q5_0 => QuantPlan::Q5_0,
            DTypeArg::Q5_1 => QuantPlan::Q5_1,
            DTypeArg::Q4_K => QuantPlan::Q4_K,
            DTypeArg::Q5_K => QuantPlan::Q5_K,
            DTypeArg::Q6_K => QuantPlan::Q6_K,
            DTypeArg::Q4_K_M => QuantPlan::Q4_K_M,
            DTypeArg::Q5_K_M => QuantPlan::Q5_K_M,
            DTypeArg::Q2_K => QuantPlan::Q2_K,
            DTypeArg::Q3_K_S => QuantPlan::Q3_K_S,
            DTypeArg::Q3_K_M => QuantPlan::Q3_K_M,
            DTypeArg::Q3_K_L => QuantPlan::Q3_K_L,
            DTypeArg::IQ4_NL => QuantPlan::IQ4_NL,
            DTypeArg::IQ4_XS => QuantPlan::IQ4_XS,
        }
    }
}

/// Whether attention is the fused op (on, the default on every backend) or the chain of
/// ops (off, the reference path).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum FlashAttn {
    On,
    Off,
}

/// KV-cache types accepted on the command line (llama.cpp's `-ctk` / `-ctv` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CacheTypeArg {
    F32,
    F16,
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl From<CacheTypeArg> for DType {
    fn from(d: CacheTypeArg) -> DType {
        match d {
            CacheTypeArg::F32 => DType::F32,
            CacheTypeArg::F16 => DType::F16,
            CacheTypeArg::Bf16 => DType::BF16,
            CacheTypeArg::Q8_0 => DType::Q8_0,
            CacheTypeArg::Q4_0 => DType::Q4_0,
        }
    }
}

/// Attention and KV-cache options of the commands that run a model.
#[derive(clap::Args, Clone, Copy, Debug)]
pub(super) struct CacheArgs {
    /// Attention as the fused flash_attn_ext op (on) or as the chain mul_mat, scale,
    /// mask, soft_max, mul_mat (off, the reference path).
    #[arg(long, value_enum, default_value_t = FlashAttn::On)]
    flash_attn: FlashAttn,
    /// Type of the K cache (q8_0 and q4_0 quantize on write).
    #[arg(long = "cache-type-k", visible_alias = "ctk", value_enum, default_value_t = CacheTypeArg::F16)]
    cache_type_k: CacheTypeArg,
    /// Type of the V cache (a quantized V cache needs --flash-attn on).
    #[arg(long = "cache-type-v", visible_alias = "ctv", value_enum, default_value_t = CacheTypeArg::F16)]
    cache_type_v: CacheTypeArg,
}

impl CacheArgs {
    /// The cache types these options ask for.
    pub(super) fn types(&self) -> graft::models::CacheTypes {
        graft::models::CacheTypes {
            k: self.cache_type_k.into(),
            v: self.cache_type_v.into(),
            flash_attn: self.flash_attn == FlashAttn::On,
        }
    }
}

/// Opens the backend asked for, split over `tp` devices when above 1.
pub(super) fn make_backend(kind: BackendKind, tp: usize) -> Result<Box<dyn Backend>> {
    match (kind, tp) {
        (BackendKind::Cpu, 1) => Ok(Box::new(CpuBackend::new())),
        (BackendKind::Cpu, n) => Ok(Box::new(DeviceGroup::cpu(n)?)),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, 1) => Ok(Box::new(graft::backend::cuda::CudaBackend::new(0)?)),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, n) => Ok(Box::new(DeviceGroup::cuda(n)?)),
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => Err(graft::Error::NoDevice(
            "this graft was built without CUDA support; rebuild with --features cuda".into(),
        )),
    }
}
