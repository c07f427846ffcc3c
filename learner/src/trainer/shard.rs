//! ZeRO-style sharding of the training state (`[learner] shard`): the ranks split the
//! fp32 weights AdamW updates, its moments and (`"gradients"`) the step's gradient sums,
//! so each holds 1/K of them; every rank keeps the whole model for its passes.
//!
//! The split is over one flat vector: every parameter flattened, in name order (the
//! order of `Trainer::params`), concatenated, zero-padded to a multiple of the world size
//! K. Rank r owns elements `r·share .. (r+1)·share`. A step reduce-scatters the summed
//! gradients into the slices (each rank gets the sum over the ranks of its slice), each
//! rank runs AdamW on its slice (elementwise, so the same arithmetic as on the whole),
//! and all-gathers the updated slices into the parameters. The padding stays zero: its
//! gradient is zero, so weight decay and AdamW leave it there.

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};
use tutor_collective::{Collective, CollectiveError};

use crate::config::Shard;

/// Elements moved per collective call when the whole state is gathered (a checkpoint):
/// bounds the device memory of the gather to world × this many f32 values.
const GATHER_CHUNK: i64 = 1 << 24;

/// Where each parameter sits in the flat vector and which slice is this rank's.
#[derive(Debug, Clone)]
pub(crate) struct FlatLayout {
    /// Elements of each parameter, in `Trainer::params` order.
    numels: Vec<i64>,
    shapes: Vec<Vec<i64>>,
    /// Elements of each rank's slice.
    share: i64,
    world: usize,
    rank: usize,
}

impl FlatLayout {
    pub(crate) fn new(params: &[Tensor], world: usize, rank: usize) -> Self {
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        let total: i64 = numels.iter().sum();
        let world = world.max(1);
        Self {
            numels,
            shapes: params.iter().map(Tensor::size).collect(),
            share: (total + world as i64 - 1) / world as i64,
            world,
            rank,
        }
    }

    /// Elements of the padded flat vector (world × share).
    pub(crate) fn padded(&self) -> i64 {
        self.share * self.world as i64
    }

    pub(crate) fn share(&self) -> i64 {
        self.share
    }

    fn start(&self) -> i64 {
        self.rank as i64 * self.share
    }

    /// The flat vector of `tensors` (shaped like the parameters) in `kind`, padded: one
    /// buffer that each tensor is copied (and cast) into, no intermediate copies.
    pub(crate) fn flatten(&self, tensors: &[Tensor], kind: Kind) -> Tensor {
        let device = tensors.first().map_or(Device::Cpu, Tensor::device);
        let flat = Tensor::zeros([self.padded()], (kind, device));
        tch::no_grad(|| {
            for (mut view, t) in self.split(&flat).into_iter().zip(tensors) {
                view.copy_(t);
            }
        });
        flat
    }

    /// This rank's slice (fp32, a copy) of `tensors` shaped like the parameters, without
    /// building the whole flat vector.
    pub(crate) fn slice_of(&self, tensors: &[Tensor]) -> Tensor {
        let device = tensors.first().map_or(Device::Cpu, Tensor::device);
        let (lo, hi) = (self.start(), self.start() + self.share);
        let mut parts = Vec::new();
        let mut offset = 0;
        for (t, &n) in tensors.iter().zip(&self.numels) {
            let (a, b) = (offset.max(lo), (offset + n).min(hi));
            if a < b {
                parts.push(
                    t.detach()
                        .reshape([-1])
                        .narrow(0, a - offset, b - a)
                        .to_kind(Kind::Float),
                );
            }
            offset += n;
        }
        let have: i64 = parts.iter().map(|p| p.numel() as i64).sum();
        if have < self.share {
            parts.push(Tensor::zeros([self.share - have], (Kind::Float, device)));
        }
        Tensor::cat(&parts, 0).copy()
    }

    /// Copies the flat vector `flat` into `params` (cast to each parameter's kind).
    pub(crate) fn unflatten_into(&self, flat: &Tensor, params: &mut [Tensor]) {
        tch::no_grad(|| {
            let mut offset = 0;
            for (p, &n) in params.iter_mut().zip(&self.numels) {
                p.copy_(&flat.narrow(0, offset, n).view(p.size().as_slice()));
                offset += n;
            }
        });
    }

    /// The flat vector cut back into tensors shaped like the parameters (views of it).
    pub(crate) fn split(&self, flat: &Tensor) -> Vec<Tensor> {
        let mut offset = 0;
        self.numels
            .iter()
            .zip(&self.shapes)
            .map(|(&n, shape)| {
                let t = flat.narrow(0, offset, n).view(shape.as_slice());
                offset += n;
                t
            })
            .collect()
    }

    /// Every rank's slice gathered, in host memory, as tensors shaped like the parameters.
    /// Every rank of the group must call it together (a collective per chunk).
    pub(crate) fn gather_to_host(
        &self,
        slice: &Tensor,
        collective: &mut dyn Collective,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let host = Tensor::zeros([self.padded()], (Kind::Float, Device::Cpu));
        let world = self.world as i64;
        let mut at = 0;
        while at < self.share {
            let len = GATHER_CHUNK.min(self.share - at);
            let mine = slice.narrow(0, at, len);
            let mut all = Tensor::zeros([world * len], (Kind::Float, slice.device()));
            collective.all_gather(&mine, &mut all)?;
            let all = all.to_device(Device::Cpu);
            for r in 0..world {
                host.narrow(0, r * self.share + at, len)
                    .copy_(&all.narrow(0, r * len, len));
            }
            at += len;
        }
        Ok(self.split(&host))
    }
}

/// A rank's sharded training state (`Trainer::sharded`).
pub(crate) struct Sharded {
    pub(crate) mode: Shard,
    pub(crate) layout: FlatLayout,
    /// This rank's slice of the fp32 weights AdamW updates (the master weights; in f32
    /// training the parameters' own values).
    pub(crate) weights: Tensor,
    /// The step's fp32 gradient sums where `.grad` cannot hold them: with `"optimizer"`
    /// in bf16 the whole flat vector (summed pass by pass), with `"gradients"` this
    /// rank's slice (each pass reduce-scattered into it); `None` with `"optimizer"` in
    /// f32 (`.grad` sums the passes).
    pub(crate) grad_sums: Option<Tensor>,
    /// The group this state was split over broke: the other ranks' slices are gone.
    pub(crate) lost: bool,
}

impl Sharded {
    /// Rank `rank` of `world`'s share of the fp32 weights `weights` (shaped like the
    /// parameters), on `device`.
    pub(crate) fn new(
        mode: Shard,
        weights: &[Tensor],
        world: usize,
        rank: usize,
        mixed_precision: bool,
        device: Device,
    ) -> Self {
        let layout = FlatLayout::new(weights, world, rank);
        let slice = tch::no_grad(|| layout.slice_of(weights)).to_device(device);
        let grad_sums = match mode {
            Shard::Gradients => Some(Tensor::zeros([layout.share()], (Kind::Float, device))),
            _ if mixed_precision => Some(Tensor::zeros([layout.padded()], (Kind::Float, device))),
            _ => None,
        };
        Self {
            mode,
            layout,
            weights: slice,
            grad_sums,
            lost: false,
        }
    }

    pub(crate) fn check_whole(&self) -> Result<()> {
        if self.lost {
            bail!(
                "the learner group broke and with learner.shard = \"{}\" the optimizer state \
                 of the lost ranks went with them: this trainer cannot go on; restart the \
                 learner to resume from its last checkpoint",
                self.mode.name()
            );
        }
        Ok(())
    }

    pub(crate) fn zero_grad_sums(&mut self) {
        if let Some(g) = &mut self.grad_sums {
            let _ = g.zero_();
        }
    }

    /// After a pass's backward with `"optimizer"` in bf16: adds each parameter's `.grad`
    /// (in f32) into the flat sums and clears it.
    pub(crate) fn add_pass_to_flat_sums(&mut self, params: &[Tensor]) {
        if self.mode != Shard::Optimizer {
            return;
        }
        let Some(sums) = &mut self.grad_sums else {
            return;
        };
        tch::no_grad(|| {
            let views = self.layout.split(sums);
            for (p, mut sum) in params.iter().zip(views) {
                let mut g = p.grad();
                if g.defined() {
                    let _ = sum.g_add_(&g.to_kind(Kind::Float));
                    let _ = g.zero_();
                }
            }
        });
    }

    /// With `"gradients"`, at the end of every pass round (every rank makes the same
    /// number): this pass's `.grad` (zero where the rank had no pass) reduce-scattered
    /// into this rank's slice of the sums, `.grad` cleared.
    pub(crate) fn reduce_pass(
        &mut self,
        params: &[Tensor],
        collective: &mut dyn Collective,
    ) -> Result<(), CollectiveError> {
        if self.mode != Shard::Gradients {
            return Ok(());
        }
        let grads: Vec<Tensor> = params.iter().map(grad_or_zeros).collect();
        let flat = self.layout.flatten(&grads, Kind::Float);
        let mut mine = Tensor::zeros([self.layout.share()], (Kind::Float, flat.device()));
        collective.reduce_scatter_sum(&flat, &mut mine)?;
        tch::no_grad(|| {
            let sums = self
                .grad_sums
                .as_mut()
                .expect("\"gradients\" keeps slice sums");
            let _ = sums.g_add_(&mine);
            for p in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        });
        Ok(())
    }

    /// At the end of the step: this rank's slice of the gradients summed over the passes
    /// and the ranks (not yet divided by the token count).
    pub(crate) fn reduced_slice(
        &mut self,
        params: &[Tensor],
        collective: &mut dyn Collective,
    ) -> Result<Tensor, CollectiveError> {
        if self.mode == Shard::Gradients {
            return Ok(self
                .grad_sums
                .as_ref()
                .expect("\"gradients\" keeps slice sums")
                .shallow_clone());
        }
        let flat = match &self.grad_sums {
            Some(sums) => sums.shallow_clone(),
            None => {
                let grads: Vec<Tensor> = params.iter().map(grad_or_zeros).collect();
                self.layout.flatten(&grads, Kind::Float)
            }
        };
        let mut mine = Tensor::zeros([self.layout.share()], (Kind::Float, flat.device()));
        collective.reduce_scatter_sum(&flat, &mut mine)?;
        Ok(mine)
    }

    /// After AdamW updated this rank's slice: every rank's slice gathered into the
    /// parameters (in their kind: bf16 parameters are the masters' rounding).
    pub(crate) fn gather_into_params(
        &self,
        params: &mut [Tensor],
        collective: &mut dyn Collective,
    ) -> Result<(), CollectiveError> {
        let kind = params.first().map_or(Kind::Float, Tensor::kind);
        let mine = self.weights.to_kind(kind);
        let mut all = Tensor::zeros([self.layout.padded()], (kind, mine.device()));
        collective.all_gather(&mine, &mut all)?;
        self.layout.unflatten_into(&all, params);
        Ok(())
    }

    /// Bytes of the training state this rank holds besides the model: the fp32 weights
    /// slice and the gradient sums.
    pub(crate) fn bytes(&self) -> (u64, u64) {
        (
            tensor_bytes(&self.weights),
            self.grad_sums.as_ref().map_or(0, tensor_bytes),
        )
    }
}

fn grad_or_zeros(p: &Tensor) -> Tensor {
    let g = p.grad();
    if g.defined() {
        g
    } else {
        p.zeros_like()
    }
}

pub(crate) fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Vec<Tensor> {
        vec![
            Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]),
            Tensor::arange(5, (Kind::Float, Device::Cpu)) + 100.0,
        ]
    }

    /// The slices of all ranks, in rank order, are the flat vector: every element in
    /// exactly one slice, the padding zero; `split` undoes `flatten`.
    #[test]
    fn slices_tile_the_flat_vector() {
        let ps = params();
        for world in 1..=4 {
            let flat = FlatLayout::new(&ps, world, 0).flatten(&ps, Kind::Float);
            assert_eq!(flat.numel() as i64 % world as i64, 0);
            let slices: Vec<Tensor> = (0..world)
                .map(|r| FlatLayout::new(&ps, world, r).slice_of(&ps))
                .collect();
            assert!(Tensor::cat(&slices, 0).equal(&flat), "world {world}");
            let back = FlatLayout::new(&ps, world, 0).split(&flat);
            for (a, b) in back.iter().zip(&ps) {
                assert!(a.equal(b));
            }
        }
        // 11 elements over 4 ranks: slices of 3, one zero of padding at the end.
        let l = FlatLayout::new(&ps, 4, 3);
        assert_eq!((l.share(), l.padded()), (3, 12));
        let last: Vec<f32> = Vec::try_from(l.slice_of(&ps)).unwrap();
        assert_eq!(last, vec![103.0, 104.0, 0.0]);
    }
}
