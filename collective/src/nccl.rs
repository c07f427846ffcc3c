//! NCCL through cudarc, on tensors that live on this rank's GPU. libnccl is loaded at
//! run time; cudarc panics when it is missing, so presence is checked first.

use std::ffi::c_void;

use cudarc::nccl::sys;
use tch::{Device, Kind, Tensor};

use crate::{Collective, CollectiveError};

/// The 128-byte NCCL unique id: rank 0 makes it, every rank needs it (the coordinator
/// hands it out over gRPC as `bytes`).
pub type NcclUniqueId = [u8; 128];

pub struct NcclCollective {
    comm: sys::ncclComm_t,
    /// The GPU's primary context (the one torch uses), bound before each operation
    /// since the collective may be used from another thread than the one that made it.
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    rank: usize,
    world_size: usize,
    ordinal: usize,
}

// The communicator is used by the one thread that owns the collective at a time.
unsafe impl Send for NcclCollective {}

fn check_library() -> Result<(), CollectiveError> {
    // SAFETY: only probes whether the shared library can be loaded.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CollectiveError::Nccl(
            "libnccl.so cannot be loaded: put the directory holding libnccl.so (pip's \
             nvidia-nccl ships libnccl.so.2: add a libnccl.so symlink) on LD_LIBRARY_PATH"
                .into(),
        ))
    }
}

fn nccl_err(what: &str, e: cudarc::nccl::result::NcclError) -> CollectiveError {
    CollectiveError::Nccl(format!("{what}: {:?}", e.0))
}

impl NcclCollective {
    /// A fresh unique id (call on rank 0 and send it to the others).
    pub fn unique_id() -> Result<NcclUniqueId, CollectiveError> {
        check_library()?;
        let id =
            cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
        Ok(id.internal.map(|c| c as u8))
    }

    /// Joins the communicator `id` as `rank` of `world_size`, on GPU `ordinal`. Blocks
    /// until all ranks have joined.
    pub fn new(
        id: &NcclUniqueId,
        rank: usize,
        world_size: usize,
        ordinal: usize,
    ) -> Result<Self, CollectiveError> {
        check_library()?;
        if rank >= world_size {
            return Err(CollectiveError::Setup(format!(
                "rank {rank} is not below world_size {world_size}"
            )));
        }
        // NCCL binds the communicator to the current device; make it this rank's.
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| CollectiveError::Nccl(format!("CUDA device {ordinal}: {e:?}")))?;
        ctx.bind_to_thread()
            .map_err(|e| CollectiveError::Nccl(format!("CUDA device {ordinal}: {e:?}")))?;
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as ::core::ffi::c_char),
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL on success.
        let comm = unsafe {
            cudarc::nccl::result::comm_init_rank(
                comm.as_mut_ptr(),
                world_size as i32,
                uid,
                rank as i32,
            )
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
            comm.assume_init()
        };
        Ok(Self {
            comm,
            ctx,
            rank,
            world_size,
            ordinal,
        })
    }

    fn check(&self, t: &Tensor) -> Result<sys::ncclDataType_t, CollectiveError> {
        if t.device() != Device::Cuda(self.ordinal) {
            return Err(CollectiveError::Setup(format!(
                "NCCL rank {} works on cuda:{}, got a tensor on {:?}",
                self.rank,
                self.ordinal,
                t.device()
            )));
        }
        if !t.is_contiguous() {
            return Err(CollectiveError::Setup(
                "NCCL needs contiguous tensors".into(),
            ));
        }
        Ok(match t.kind() {
            Kind::Float => sys::ncclDataType_t::ncclFloat32,
            Kind::Double => sys::ncclDataType_t::ncclFloat64,
            Kind::Half => sys::ncclDataType_t::ncclFloat16,
            Kind::BFloat16 => sys::ncclDataType_t::ncclBfloat16,
            Kind::Int64 => sys::ncclDataType_t::ncclInt64,
            Kind::Uint8 => sys::ncclDataType_t::ncclUint8,
            other => {
                return Err(CollectiveError::Setup(format!(
                    "NCCL collective: unsupported tensor kind {other:?}"
                )))
            }
        })
    }

    /// Runs `f` on each tensor inside one NCCL group, on the default stream torch
    /// uses, then waits for the device so the results are visible to any stream.
    fn each(
        &self,
        tensors: &mut [Tensor],
        what: &str,
        f: impl Fn(*mut c_void, usize, sys::ncclDataType_t) -> sys::ncclResult_t,
    ) -> Result<(), CollectiveError> {
        let kinds = tensors
            .iter()
            .map(|t| self.check(t))
            .collect::<Result<Vec<_>, _>>()?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CollectiveError::Nccl(format!("binding cuda:{}: {e:?}", self.ordinal)))?;
        cudarc::nccl::result::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        for (t, kind) in tensors.iter_mut().zip(kinds) {
            let r = f(t.data_ptr(), t.numel(), kind);
            if let Err(e) = r.result() {
                let _ = cudarc::nccl::result::group_end();
                return Err(nccl_err(what, e));
            }
        }
        cudarc::nccl::result::group_end().map_err(|e| nccl_err("ncclGroupEnd", e))?;
        // Waits for the current context (bound in `new`) so results are visible to
        // whatever stream reads them next.
        cudarc::driver::result::ctx::synchronize()
            .map_err(|e| CollectiveError::Nccl(format!("synchronising after {what}: {e:?}")))?;
        Ok(())
    }

    /// `each` on tensors that may live on the host: those are staged through this
    /// rank's GPU and copied back (the trainer keeps its tensors on the CPU today).
    /// `copy_back`: whether the results go back into host tensors (not for the root of a
    /// broadcast, whose values do not change).
    fn staged(
        &self,
        tensors: &mut [Tensor],
        what: &str,
        copy_back: bool,
        f: impl Fn(*mut c_void, usize, sys::ncclDataType_t) -> sys::ncclResult_t,
    ) -> Result<(), CollectiveError> {
        let gpu = Device::Cuda(self.ordinal);
        if tensors.iter().all(|t| t.device() == gpu) {
            return self.each(tensors, what, f);
        }
        let mut work: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                if t.device() == gpu {
                    t.shallow_clone()
                } else {
                    t.to_device(gpu).contiguous()
                }
            })
            .collect();
        self.each(&mut work, what, f)?;
        if !copy_back {
            return Ok(());
        }
        tch::no_grad(|| {
            for (t, w) in tensors.iter_mut().zip(&work) {
                if t.device() != gpu {
                    t.copy_(w);
                }
            }
        });
        Ok(())
    }
}

impl NcclCollective {
    /// One NCCL operation from `input` into `output` (either may live on the host: staged
    /// through this rank's GPU; `output` is written in place), `f(send, recv, kind)`.
    fn input_to_output(
        &self,
        input: &Tensor,
        output: &mut Tensor,
        what: &str,
        f: impl FnOnce(*const c_void, *mut c_void, sys::ncclDataType_t) -> sys::ncclResult_t,
    ) -> Result<(), CollectiveError> {
        let gpu = Device::Cuda(self.ordinal);
        if input.kind() != output.kind() {
            return Err(CollectiveError::Setup(format!(
                "{what}: input is {:?}, output {:?}",
                input.kind(),
                output.kind()
            )));
        }
        let send = input.to_device(gpu).contiguous();
        let staged = output.device() != gpu || !output.is_contiguous();
        let recv = if staged {
            Tensor::empty(output.size(), (output.kind(), gpu))
        } else {
            output.shallow_clone()
        };
        let kind = self.check(&send)?;
        self.check(&recv)?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CollectiveError::Nccl(format!("binding cuda:{}: {e:?}", self.ordinal)))?;
        f(send.data_ptr(), recv.data_ptr(), kind)
            .result()
            .map_err(|e| nccl_err(what, e))?;
        cudarc::driver::result::ctx::synchronize()
            .map_err(|e| CollectiveError::Nccl(format!("synchronising after {what}: {e:?}")))?;
        if staged {
            tch::no_grad(|| output.copy_(&recv));
        }
        Ok(())
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn all_reduce_sum(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError> {
        let comm = self.comm;
        self.staged(tensors, "ncclAllReduce", true, |ptr, n, kind| unsafe {
            sys::ncclAllReduce(
                ptr as *const c_void,
                ptr,
                n,
                kind,
                sys::ncclRedOp_t::ncclSum,
                comm,
                std::ptr::null_mut(),
            )
        })
    }

    fn broadcast(&mut self, tensors: &mut [Tensor]) -> Result<(), CollectiveError> {
        let comm = self.comm;
        self.staged(
            tensors,
            "ncclBroadcast",
            self.rank != 0,
            |ptr, n, kind| unsafe {
                sys::ncclBroadcast(
                    ptr as *const c_void,
                    ptr,
                    n,
                    kind,
                    0,
                    comm,
                    std::ptr::null_mut(),
                )
            },
        )
    }

    fn broadcast_bytes_max(
        &mut self,
        data: &mut Vec<u8>,
        max: usize,
    ) -> Result<(), CollectiveError> {
        if self.world_size == 1 {
            return Ok(());
        }
        // The length first, so the other ranks can size their buffer.
        let gpu = Device::Cuda(self.ordinal);
        let mut len = [Tensor::from_slice(&[data.len() as i64]).to_device(gpu)];
        self.broadcast(&mut len)?;
        let n = len[0].int64_value(&[0]) as usize;
        // Every rank (rank 0 too) checks the length they all got, so they fail together
        // instead of leaving some in the next broadcast.
        if n > max {
            return Err(CollectiveError::Nccl(format!(
                "rank {}: rank 0 broadcasts {n} bytes, more than the {max} expected: refused \
                 before allocating them",
                self.rank
            )));
        }
        if n == 0 {
            data.clear();
            return Ok(());
        }
        let mut buf = [if self.rank == 0 {
            Tensor::from_slice(data.as_slice()).to_device(gpu)
        } else {
            Tensor::zeros([n as i64], (Kind::Uint8, gpu))
        }];
        self.broadcast(&mut buf)?;
        if self.rank != 0 {
            data.resize(n, 0);
            buf[0]
                .to_device(Device::Cpu)
                .copy_data(data.as_mut_slice(), n);
        }
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        input: &Tensor,
        output: &mut Tensor,
    ) -> Result<(), CollectiveError> {
        crate::check_shares("reduce_scatter_sum", input, output, self.world_size)?;
        let (comm, n) = (self.comm, output.numel());
        self.input_to_output(
            input,
            output,
            "ncclReduceScatter",
            |send, recv, kind| unsafe {
                sys::ncclReduceScatter(
                    send,
                    recv,
                    n,
                    kind,
                    sys::ncclRedOp_t::ncclSum,
                    comm,
                    std::ptr::null_mut(),
                )
            },
        )
    }

    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<(), CollectiveError> {
        crate::check_shares("all_gather", output, input, self.world_size)?;
        let (comm, n) = (self.comm, input.numel());
        self.input_to_output(input, output, "ncclAllGather", |send, recv, kind| unsafe {
            sys::ncclAllGather(send, recv, n, kind, comm, std::ptr::null_mut())
        })
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut t = [Tensor::zeros(
            [1],
            (Kind::Float, Device::Cuda(self.ordinal)),
        )];
        self.all_reduce_sum(&mut t)
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // SAFETY: the communicator was created in `new` and is destroyed once.
        unsafe {
            let _ = cudarc::nccl::result::comm_destroy(self.comm);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Built with the `nccl` feature on a machine without a GPU (as `make test` is):
    /// where libnccl cannot be loaded, asking for a group is an error that says what to
    /// put where, never cudarc's panic; where it can be (a GPU machine with
    /// LD_LIBRARY_PATH set), rank 0's unique id is made without a device.
    #[test]
    fn without_libnccl_a_group_is_an_error_that_says_where_to_put_it() {
        match NcclCollective::unique_id() {
            Ok(id) => assert!(id.iter().any(|&b| b != 0), "a unique id of zeros"),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    msg.contains("libnccl.so") && msg.contains("LD_LIBRARY_PATH"),
                    "{msg}"
                );
                let joined = NcclCollective::new(&[0u8; 128], 0, 2, 0);
                let msg = joined.err().expect("no group without libnccl").to_string();
                assert!(msg.contains("libnccl.so"), "{msg}");
            }
        }
    }
}
