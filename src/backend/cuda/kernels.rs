//! The compiled kernels: the fatbins of `cuda/*.cu` embedded by build.rs, one constant per
//! kernel in [`k`] (names parsed from the sources, so a misspelt kernel fails to compile),
//! each typed by the argument struct its declaration takes ([`Kernel`]`<A>`: a launch with
//! another struct fails to compile), kernel sets keyed by dtypes in [`by`]
//! (`by::ADD.get([a, b])`: from the `_<dtype>` suffixes of the kernel names), those sets
//! keyed by head dim in [`dims`] and by column count in [`cols`] (from a `_d<N>` or `_c<N>`
//! before the dtypes), [`unary`] / [`binary`] (each op variant's set, generated from the
//! CUDA functors), and [`KernelTable`], every module loaded into a context with a handle
//! per kernel.

use std::ffi::CString;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext};

use super::device::driver_error;
use crate::error::{Error, Result};
use crate::graph::DType;

/// One kernel of one module, whatever its argument struct: what a launch records and the
/// loaded table looks up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelId {
    /// Position in [`ALL`] (and in a [`KernelTable`]).
    pub index: usize,
    /// Position of its module in [`MODULES`].
    pub module: usize,
    /// The `extern "C"` name.
    pub name: &'static str,
    /// The blocks per SM its `__launch_bounds__` asks to keep resident (0: none given).
    pub resident: u32,
}

/// A kernel whose only parameter is the argument struct `A` (`cuda/args.cuh`), as its
/// declaration says: [`DevOp::kernel`](super::lowering::DevOp::kernel) takes an `A` with it.
pub struct Kernel<A> {
    /// The kernel.
    pub id: KernelId,
    args: PhantomData<fn(A)>,
}

impl<A> Kernel<A> {
    /// The kernel `id`, which takes `A` (the generated tables are the only callers).
    pub(crate) const fn new(id: KernelId) -> Self {
        Kernel {
            id,
            args: PhantomData,
        }
    }
}

impl<A> Clone for Kernel<A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A> Copy for Kernel<A> {}

impl<A> std::fmt::Debug for Kernel<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.id.fmt(f)
    }
}

/// The kernels of one family (`<family>_<dtype>..` in the sources), keyed by the dtypes
/// their names end in: how lowering picks a kernel for an op and its operands' dtypes.
pub struct KernelSet<A: 'static, const N: usize> {
    /// The family (the kernel names without their dtype suffixes).
    pub name: &'static str,
    /// Every kernel of the family with its dtypes.
    pub entries: &'static [([DType; N], Kernel<A>)],
}

impl<A, const N: usize> Clone for KernelSet<A, N> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A, const N: usize> Copy for KernelSet<A, N> {}

impl<A, const N: usize> KernelSet<A, N> {
    /// The kernel for these dtypes, or why there is none.
    pub fn get(&self, key: [DType; N]) -> std::result::Result<Kernel<A>, String> {
        self.entries
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, kernel)| *kernel)
            .ok_or_else(|| {
                let names: Vec<&str> = key.iter().map(|d| d.name()).collect();
                format!("no {} kernel for dtypes {}", self.name, names.join(", "))
            })
    }
}

/// Kernel sets of one family named `<family>_d<N>_..` (a head dim) or `<family>_c<N>_..`
/// (a column count), keyed by `N`, in increasing order.
pub struct KeyedSets<A: 'static, const N: usize> {
    /// The family (the set names without their `_d<N>` or `_c<N>`).
    pub name: &'static str,
    /// What the key is ("head dim", "column count").
    pub key: &'static str,
    /// Every set with its key, in increasing order of the key.
    pub entries: &'static [(usize, KernelSet<A, N>)],
}

impl<A, const N: usize> Clone for KeyedSets<A, N> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A, const N: usize> Copy for KeyedSets<A, N> {}

impl<A, const N: usize> KeyedSets<A, N> {
    /// The set of key `n`, or why there is none (naming the keys there are).
    pub fn get(&self, n: usize) -> std::result::Result<KernelSet<A, N>, String> {
        self.entries
            .iter()
            .find(|(key, _)| *key == n)
            .map(|(_, set)| *set)
            .ok_or_else(|| self.missing(n))
    }

    /// The set of the smallest key of at least `n` (the kernel for up to that many columns),
    /// or why there is none.
    pub fn covering(&self, n: usize) -> std::result::Result<KernelSet<A, N>, String> {
        self.entries
            .iter()
            .find(|(key, _)| *key >= n)
            .map(|(_, set)| *set)
            .ok_or_else(|| self.missing(n))
    }

    fn missing(&self, n: usize) -> String {
        let keys: Vec<String> = self.entries.iter().map(|(k, _)| k.to_string()).collect();
        format!(
            "no {} kernel for {} {n} ({})",
            self.name,
            self.key,
            keys.join(", ")
        )
    }
}

/// The fatbin of one `cuda/NAME.cu`.
#[derive(Clone, Copy, Debug)]
pub struct ModuleImage {
    /// The file stem (`norm` for `cuda/norm.cu`).
    pub name: &'static str,
    /// The fatbin bytes.
    pub image: &'static [u8],
}

/// 64-byte alignment for an embedded fatbin (the driver reads it in place).
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// A loaded module; unloaded on drop.
struct LoadedModule {
    module: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

impl Drop for LoadedModule {
    fn drop(&mut self) {
        // Errors cannot be reported from drop; the context records them.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: the module was loaded by KernelTable::load and is unloaded once, here;
        // every function handle of it is dropped with the table first.
        self.ctx
            .record_err(unsafe { result::module::unload(self.module) });
    }
}

/// Every module loaded into one context, with a function handle per kernel of [`ALL`].
pub struct KernelTable {
    funcs: Vec<sys::CUfunction>,
    /// Static shared memory of each kernel, bytes.
    static_smem: Vec<u32>,
    smem: SmemLimits,
    _modules: Vec<LoadedModule>,
}

/// The shared memory of the GPU the table is loaded on, bytes.
#[derive(Clone, Copy, Debug)]
pub struct SmemLimits {
    /// What an SM holds.
    pub per_sm: u32,
    /// What the system reserves for each resident block.
    pub reserved: u32,
    /// What a block may have without opting in.
    pub per_block: u32,
}

impl SmemLimits {
    /// Dynamic shared memory for a block with `static_smem` bytes of its own so that `n`
    /// such blocks fit on an SM and `n + 1` do not: 0 when its own shared memory already
    /// keeps the count to `n` or less, or when the reservation would not leave room for
    /// `n` or would pass `per_block`.
    pub fn cap(&self, static_smem: u32, n: u32) -> u32 {
        if n == 0 {
            return 0;
        }
        let own = static_smem + self.reserved;
        // the smallest footprint of which n + 1 exceed the SM
        let want = self.per_sm / (n + 1) + 1;
        if own >= want || want * n > self.per_sm || want - self.reserved > self.per_block {
            return 0;
        }
        want - own
    }
}

impl KernelTable {
    /// Loads every module and looks up every kernel; fails naming the first module or
    /// kernel that the driver refuses.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))?;
        let mut modules = Vec::with_capacity(MODULES.len());
        for m in MODULES {
            // SAFETY: `image` is a complete fatbin embedded by build.rs, 64-byte aligned,
            // valid for the whole program.
            let module = unsafe { result::module::load_data(m.image.as_ptr().cast()) }
                .map_err(|e| module_error(ctx, m.name, e))?;
            modules.push(LoadedModule {
                module,
                ctx: ctx.clone(),
            });
        }
        let mut funcs = Vec::with_capacity(ALL.len());
        let mut static_smem = Vec::with_capacity(ALL.len());
        for k in ALL {
            debug_assert_eq!(k.index, funcs.len());
            let name = CString::new(k.name).expect("kernel names have no NUL");
            // SAFETY: the module is loaded and stays loaded as long as the table.
            let f = unsafe { result::module::get_function(modules[k.module].module, name) }
                .map_err(|e| Error::Backend {
                    backend: "cuda",
                    msg: format!(
                        "kernel {} not found in module {}: {}",
                        k.name,
                        MODULES[k.module].name,
                        driver_error("cuModuleGetFunction", e)
                    ),
                })?;
            // Load the code now (module loading is lazy by default), so that no launch
            // loads it later, in the middle of a stream capture.
            // SAFETY: `f` is a valid function handle of a loaded module.
            unsafe { sys::cuFuncLoad(f) }
                .result()
                .map_err(|e| driver_error(&format!("cuFuncLoad({})", k.name), e))?;
            // SAFETY: as for cuFuncLoad.
            let shared = unsafe {
                result::function::get_function_attribute(
                    f,
                    sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
                )
            }
            .map_err(|e| driver_error(&format!("cuFuncGetAttribute({})", k.name), e))?;
            funcs.push(f);
            static_smem.push(shared as u32);
        }
        let attr = |a, what: &str| {
            ctx.attribute(a)
                .map(|v| v as u32)
                .map_err(|e| driver_error(&format!("cuDeviceGetAttribute({what})"), e))
        };
        use sys::CUdevice_attribute as D;
        let smem = SmemLimits {
            per_sm: attr(
                D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                "shared memory per SM",
            )?,
            reserved: attr(
                D::CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK,
                "reserved shared memory per block",
            )?,
            per_block: attr(
                D::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
                "shared memory per block",
            )?,
        };
        Ok(KernelTable {
            funcs,
            static_smem,
            smem,
            _modules: modules,
        })
    }

    /// The dynamic shared memory a launch of `k` reserves so that at most `n` of its
    /// blocks share an SM ([`SmemLimits::cap`]; 0 for `n` = 0: no limit).
    pub fn smem_cap(&self, k: KernelId, n: u32) -> u32 {
        self.smem.cap(self.static_smem[k.index], n)
    }

    /// The function handle of `k`.
    pub fn func(&self, k: KernelId) -> sys::CUfunction {
        self.funcs[k.index]
    }

    /// An attribute of `k` (registers, local memory, maximum block size, ...).
    pub fn attribute(&self, k: KernelId, attr: sys::CUfunction_attribute_enum) -> Result<i32> {
        // SAFETY: the handle belongs to a loaded module of this table.
        unsafe { result::function::get_function_attribute(self.func(k), attr) }
            .map_err(|e| driver_error("cuFuncGetAttribute", e))
    }
}

/// A module the driver refused, with the likely cause.
fn module_error(ctx: &CudaContext, module: &str, e: result::DriverError) -> Error {
    let cc = ctx
        .compute_capability()
        .map(|(a, b)| format!("sm_{a}{b}"))
        .unwrap_or_else(|_| "unknown".into());
    #[allow(clippy::wildcard_enum_match_arm)] // the driver's error list: others get no hint
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU | sys::CUresult::CUDA_ERROR_INVALID_IMAGE => {
            format!(
                "the kernels were not built for this GPU ({cc}); rebuild with GRAFT_CUDA_ARCHS \
                 including its compute capability"
            )
        }
        sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
            "the PTX is newer than the driver: build with nvcc 13.0 \
             (scripts/install-cuda-toolchain.sh) or add this GPU's SASS to GRAFT_CUDA_ARCHS"
                .into()
        }
        _ => format!("GPU {cc}"),
    };
    Error::Backend {
        backend: "cuda",
        msg: format!(
            "cannot load kernel module {module}: {}; {hint}",
            driver_error("cuModuleLoadData", e)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::SmemLimits;

    /// The reservation leaves room for exactly n blocks wherever it can, never passes a
    /// block's limit, and is 0 where the block's own memory already caps it.
    #[test]
    fn smem_cap_leaves_room_for_n_blocks() {
        // H100/H200, A100, RTX 30xx/40xx
        for per_sm in [233_472, 167_936, 102_400] {
            let lim = SmemLimits {
                per_sm,
                reserved: 1024,
                per_block: 49_152,
            };
            let fit = |own: u32| per_sm / (own + lim.reserved);
            for n in 1..=16 {
                for st in (0..49_152).step_by(1000).chain([17_464]) {
                    let cap = lim.cap(st, n);
                    if cap > 0 {
                        assert_eq!(fit(st + cap), n, "{per_sm} {st} {n}: {cap}");
                        assert!(st + cap <= lim.per_block);
                    } else {
                        // already n or fewer, or the reservation would not fit a block
                        let want = per_sm / (n + 1) + 1 - lim.reserved;
                        assert!(fit(st) <= n || want > lim.per_block, "{per_sm} {st} {n}");
                    }
                }
            }
        }
        // the streamed attention kernel on an H200: 17,464 bytes of its own, 4 an SM
        let h200 = SmemLimits {
            per_sm: 233_472,
            reserved: 1024,
            per_block: 49_152,
        };
        assert_eq!(h200.cap(17_464, 4), 28_207);
        assert_eq!(h200.cap(17_464, 0), 0);
        // 2 an SM would need 76 KB a block: more than a block gets
        assert_eq!(h200.cap(17_464, 2), 0);
    }
}
