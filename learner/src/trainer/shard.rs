//! ZeRO-style sharding of the training state (`[learner] shard`): the ranks split the
//! fp32 weights AdamW updates, its moments and (`"gradients"`) the step's gradient sums,
//! so each holds 1/K of them; every rank keeps the whole model for its passes.
//!
//! The split is over one flat vector: every parameter flattened, in name order (the
//! order of `Trainer::params`), concatenated and cut into units (`FlatLayout`: buckets
//! of consecutive whole parameters up to `[learner] bucket_mb`, or with `"full"` one
//! unit per decoder layer and one for the rest), each zero-padded to a multiple of the
//! world size K. Rank r owns the r-th K-th of every unit; its slice is those parts, unit
//! after unit. A step reduce-scatters the summed gradients into the slices unit by unit
//! (each rank gets the sum over the ranks of its parts), each rank runs AdamW on its
//! slice (elementwise, so the same arithmetic as on the whole), and all-gathers the
//! updated slices into the parameters unit by unit. The padding stays zero: its gradient
//! is zero, so weight decay and AdamW leave it there.

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};
use tutor_collective::{Collective, CollectiveError};

use crate::config::Shard;

/// Elements moved per collective call when the whole state is gathered (a checkpoint):
/// bounds the device memory of the gather to world × this many f32 values.
const GATHER_CHUNK: i64 = 1 << 24;

/// Elements `start .. start + len` of tensor `tensor` (flattened): a part of one call of
/// a bucketed broadcast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) tensor: usize,
    pub(crate) start: i64,
    pub(crate) len: i64,
}

/// The calls of `broadcast_in_buckets` for tensors of these numbers of elements:
/// consecutive whole tensors of at most `bucket` elements per call (`bucket_ranges`), and
/// a larger tensor in runs of `bucket` elements, a call each; so no call moves more than
/// a bucket, whatever the largest tensor (a vocabulary's embedding).
pub(crate) fn broadcast_calls(numels: &[i64], bucket: i64) -> Vec<Vec<Piece>> {
    let mut calls = Vec::new();
    for range in bucket_ranges(numels.iter().copied(), bucket) {
        let (first, n) = (range.start, numels[range.start]);
        if range.len() == 1 && n > bucket {
            calls.extend(chunks(n, bucket).map(|(start, len)| {
                vec![Piece {
                    tensor: first,
                    start,
                    len,
                }]
            }));
        } else {
            calls.push(
                range
                    .map(|tensor| Piece {
                        tensor,
                        start: 0,
                        len: numels[tensor],
                    })
                    .collect(),
            );
        }
    }
    calls
}

/// Tensors with these numbers of elements cut into runs of consecutive tensors of at
/// most `bucket` elements each (a larger tensor alone), as index ranges: the units of the
/// bucketed layouts and the calls of `broadcast_calls` (which cut a larger tensor
/// further).
fn bucket_ranges(numels: impl Iterator<Item = i64>, bucket: i64) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut filled = 0i64;
    for (i, n) in numels.enumerate() {
        match out.last_mut() {
            Some(last) if filled + n <= bucket => last.end = i + 1,
            _ => {
                out.push(i..i + 1);
                filled = 0;
            }
        }
        filled += n;
    }
    out
}

/// Elements of a tensor of this shape.
fn numel(shape: &[i64]) -> i64 {
    shape.iter().product()
}

/// `0..len` cut into runs of at most `bucket` elements: (start, length) of each. How a
/// slice of the moments goes to a joining rank (`lead_group`, `join_group`).
pub(crate) fn chunks(len: i64, bucket: i64) -> impl Iterator<Item = (i64, i64)> {
    let bucket = bucket.max(1);
    (0..len)
        .step_by(bucket as usize)
        .map(move |at| (at, bucket.min(len - at)))
}

/// Where each parameter sits in the flat vector and which slice is this rank's.
///
/// The flat vector is cut into units (for `"optimizer"` and `"gradients"` buckets of
/// consecutive whole parameters of at most `[learner] bucket_mb`, a larger parameter
/// alone; with `"full"` the embedding/head unit and one per decoder layer, as
/// `tutor_policy::param_unit` groups them), each zero-padded to a multiple of the world
/// size K and split into K equal parts. Rank r's slice is its part of every unit, unit
/// after unit: so one unit is gathered, or its gradients reduce-scattered, with one
/// collective call that involves nothing else.
#[derive(Debug, Clone)]
pub(crate) struct FlatLayout {
    /// Elements of each parameter, in `Trainer::params` order.
    numels: Vec<i64>,
    shapes: Vec<Vec<i64>>,
    /// Where each parameter starts in the flat vector.
    offsets: Vec<i64>,
    units: Vec<Unit>,
    /// Elements of each rank's slice (the sum of the units' parts).
    share: i64,
    world: usize,
    rank: usize,
}

#[derive(Debug, Clone)]
pub(crate) struct Unit {
    /// Its parameters (indices into `Trainer::params`), in flat order.
    pub(crate) params: Vec<usize>,
    /// Where it starts in the flat vector.
    pub(crate) start: i64,
    /// Its elements with padding: world × `part`.
    pub(crate) padded: i64,
    /// Each rank's part of it.
    pub(crate) part: i64,
    /// Where this rank's part of it starts in the rank's slice.
    pub(crate) in_slice: i64,
}

impl FlatLayout {
    /// One unit: every parameter, in order.
    #[cfg(test)]
    pub(crate) fn new(params: &[Tensor], world: usize, rank: usize) -> Self {
        Self::with_units(params, &[(0..params.len()).collect()], world, rank)
    }

    /// The layout a sharding mode uses for parameters named `names` (name order):
    /// `"full"` a unit per decoder layer and one for the rest; the other modes units of
    /// consecutive parameters up to `bucket` elements each (a larger parameter alone), so
    /// no exchange of a step moves more than a bucket, or that parameter, at once.
    pub(crate) fn for_mode(
        mode: Shard,
        bucket: i64,
        names: &[String],
        params: &[Tensor],
        world: usize,
        rank: usize,
    ) -> Self {
        let shapes: Vec<Vec<i64>> = params.iter().map(Tensor::size).collect();
        Self::for_shapes(mode, bucket, names, &shapes, world, rank)
    }

    /// `for_mode` for parameters of these shapes (not at hand: a joining rank's).
    pub(crate) fn for_shapes(
        mode: Shard,
        bucket: i64,
        names: &[String],
        shapes: &[Vec<i64>],
        world: usize,
        rank: usize,
    ) -> Self {
        if mode != Shard::Full {
            let units: Vec<Vec<usize>> = bucket_ranges(shapes.iter().map(|s| numel(s)), bucket)
                .into_iter()
                .map(|r| r.collect())
                .collect();
            return Self::with_unit_shapes(shapes, &units, world, rank);
        }
        let mut units: Vec<Vec<usize>> = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let u = tutor_policy::param_unit(name);
            if units.len() <= u {
                units.resize_with(u + 1, Vec::new);
            }
            units[u].push(i);
        }
        Self::with_unit_shapes(shapes, &units, world, rank)
    }

    /// `units` (indices into `params`, each parameter in exactly one), in that order.
    #[cfg(test)]
    pub(crate) fn with_units(
        params: &[Tensor],
        units: &[Vec<usize>],
        world: usize,
        rank: usize,
    ) -> Self {
        let shapes: Vec<Vec<i64>> = params.iter().map(Tensor::size).collect();
        Self::with_unit_shapes(&shapes, units, world, rank)
    }

    fn with_unit_shapes(
        shapes: &[Vec<i64>],
        units: &[Vec<usize>],
        world: usize,
        rank: usize,
    ) -> Self {
        let numels: Vec<i64> = shapes.iter().map(|s| numel(s)).collect();
        let world = world.max(1);
        let mut offsets = vec![0i64; shapes.len()];
        let (mut at, mut share) = (0i64, 0i64);
        let units = units
            .iter()
            .map(|members| {
                let start = at;
                for &j in members {
                    offsets[j] = at;
                    at += numels[j];
                }
                let part = (at - start + world as i64 - 1) / world as i64;
                at = start + part * world as i64;
                let unit = Unit {
                    params: members.clone(),
                    start,
                    padded: part * world as i64,
                    part,
                    in_slice: share,
                };
                share += part;
                unit
            })
            .collect();
        Self {
            numels,
            shapes: shapes.to_vec(),
            offsets,
            units,
            share,
            world,
            rank,
        }
    }

    pub(crate) fn units(&self) -> &[Unit] {
        &self.units
    }

    /// Elements of the padded flat vector (world × share).
    pub(crate) fn padded(&self) -> i64 {
        self.share * self.world as i64
    }

    pub(crate) fn share(&self) -> i64 {
        self.share
    }

    /// Each parameter of `unit` (its index) with its elements of the gathered unit
    /// `all`, shaped like it (views of `all`).
    pub(crate) fn unit_views<'a>(
        &'a self,
        unit: &'a Unit,
        all: &'a Tensor,
    ) -> impl Iterator<Item = (usize, Tensor)> + 'a {
        unit.params.iter().map(move |&j| {
            let at = self.offsets[j] - unit.start;
            let view = all
                .narrow(0, at, self.numels[j])
                .view(self.shapes[j].as_slice());
            (j, view)
        })
    }

    /// The flat vector of `tensors` (shaped like the parameters) in `kind`, padded: one
    /// buffer that each tensor is copied (and cast) into, no intermediate copies.
    #[cfg(test)]
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

    /// Unit `unit` of the flat vector of `tensors` (shaped like the parameters) in
    /// `kind`, padded: one buffer of the unit's size.
    pub(crate) fn flatten_unit(&self, unit: &Unit, tensors: &[Tensor], kind: Kind) -> Tensor {
        let device = tensors.first().map_or(Device::Cpu, Tensor::device);
        let buffer = Tensor::zeros([unit.padded], (kind, device));
        tch::no_grad(|| {
            for (j, mut view) in self.unit_views(unit, &buffer) {
                view.copy_(&tensors[j]);
            }
        });
        buffer
    }

    /// This rank's slice (fp32, a copy) of `tensors` shaped like the parameters, without
    /// building the whole flat vector.
    pub(crate) fn slice_of(&self, tensors: &[Tensor]) -> Tensor {
        let device = tensors.first().map_or(Device::Cpu, Tensor::device);
        let mut parts = Vec::new();
        for unit in &self.units {
            let mut have = 0;
            for &j in &unit.params {
                if let Some((_, from, len)) = self.mine(unit, self.offsets[j], self.numels[j]) {
                    parts.push(
                        tensors[j]
                            .detach()
                            .reshape([-1])
                            .narrow(0, from, len)
                            .to_kind(Kind::Float),
                    );
                    have += len;
                }
            }
            if have < unit.part {
                parts.push(Tensor::zeros([unit.part - have], (Kind::Float, device)));
            }
        }
        if parts.is_empty() {
            return Tensor::zeros([0], (Kind::Float, device));
        }
        Tensor::cat(&parts, 0).copy()
    }

    /// The part of flat elements `offset .. offset + n` (within `unit`) that is this
    /// rank's: where it goes in the rank's slice, where it starts among the `n`, and how
    /// many elements; `None` when none is.
    fn mine(&self, unit: &Unit, offset: i64, n: i64) -> Option<(i64, i64, i64)> {
        let lo = unit.start + self.rank as i64 * unit.part;
        let (a, b) = (offset.max(lo), (offset + n).min(lo + unit.part));
        (a < b).then(|| (unit.in_slice + a - lo, a - offset, b - a))
    }

    /// The flat vector cut back into tensors shaped like the parameters (views of it).
    pub(crate) fn split(&self, flat: &Tensor) -> Vec<Tensor> {
        self.offsets
            .iter()
            .zip(&self.numels)
            .zip(&self.shapes)
            .map(|((&offset, &n), shape)| flat.narrow(0, offset, n).view(shape.as_slice()))
            .collect()
    }

    /// Every rank's slice gathered to rank 0, in its host memory, as tensors shaped like
    /// the parameters (`None` on the other ranks, which only send theirs and hold no
    /// copy of the whole). Every rank of the group must call it together (a collective
    /// per chunk).
    pub(crate) fn gather_to_host(
        &self,
        slice: &Tensor,
        collective: &mut dyn Collective,
    ) -> Result<Option<Vec<Tensor>>, CollectiveError> {
        let root = self.rank == 0;
        let host = root.then(|| Tensor::zeros([self.padded()], (Kind::Float, Device::Cpu)));
        let world = self.world as i64;
        for unit in &self.units {
            let mut at = 0;
            while at < unit.part {
                let len = GATHER_CHUNK.min(unit.part - at);
                let mine = slice.narrow(0, unit.in_slice + at, len);
                match &host {
                    Some(host) => {
                        let mut all = Tensor::zeros([world * len], (Kind::Float, slice.device()));
                        collective.gather_to_root(&mine, Some(&mut all))?;
                        let all = all.to_device(Device::Cpu);
                        for r in 0..world {
                            host.narrow(0, unit.start + r * unit.part + at, len)
                                .copy_(&all.narrow(0, r * len, len));
                        }
                    }
                    None => collective.gather_to_root(&mine, None)?,
                }
                at += len;
            }
        }
        Ok(host.map(|h| self.split(&h)))
    }

    /// This rank's slice of the sum over the ranks of a flat vector given unit by unit:
    /// `unit_input(unit)` is the unit's padded fp32 elements (a view of a flat vector
    /// held anyway, or a buffer made for the call and freed after it). One reduce-scatter
    /// per unit.
    pub(crate) fn reduce_scatter(
        &self,
        device: Device,
        mut unit_input: impl FnMut(&Unit) -> Tensor,
        collective: &mut dyn Collective,
    ) -> Result<Tensor, CollectiveError> {
        let mine = Tensor::zeros([self.share], (Kind::Float, device));
        for unit in &self.units {
            if unit.part == 0 {
                continue;
            }
            let mut part = mine.narrow(0, unit.in_slice, unit.part);
            collective.reduce_scatter_sum(&unit_input(unit), &mut part)?;
        }
        Ok(mine)
    }

    /// Unit `unit` of the flat vector whose slices are `slice` (each rank's), in `kind`:
    /// one all-gather.
    pub(crate) fn all_gather_unit(
        &self,
        unit: &Unit,
        slice: &Tensor,
        kind: Kind,
        collective: &mut dyn Collective,
    ) -> Result<Tensor, CollectiveError> {
        let mine = slice.narrow(0, unit.in_slice, unit.part).to_kind(kind);
        // Every element is written by the gather.
        let mut all = Tensor::empty([unit.padded], (kind, slice.device()));
        if unit.part > 0 {
            collective.all_gather(&mine, &mut all)?;
        }
        Ok(all)
    }
}

/// What `receive_slice_in_buckets` hands each piece to: the parameter's index, where the
/// piece starts in the flattened parameter, its values.
pub(crate) type KeepPiece<'a> = dyn FnMut(usize, i64, &Tensor) + 'a;

/// A rank joining a sharded group (`Trainer::join_group`): receives rank 0's fp32
/// weights as `broadcast_in_buckets` sends them (`broadcast_calls`: at most `bucket`
/// elements per call, in host memory) and keeps this rank's slice of each call's pieces,
/// the padding zero: the same slice as `layout.slice_of` the whole weights, without ever
/// holding more than one bucket of them. `keep` is given each piece as it arrives (the
/// parameter's index, where the piece starts in the flattened parameter, its values),
/// for the modes that keep the whole model.
pub(crate) fn receive_slice_in_buckets(
    collective: &mut dyn Collective,
    layout: &FlatLayout,
    bucket: i64,
    mut keep: Option<&mut KeepPiece>,
) -> Result<Tensor, CollectiveError> {
    let slice = Tensor::zeros([layout.share], (Kind::Float, Device::Cpu));
    let mut unit_of = vec![0; layout.numels.len()];
    for (u, unit) in layout.units.iter().enumerate() {
        for &j in &unit.params {
            unit_of[j] = u;
        }
    }
    for call in broadcast_calls(&layout.numels, bucket) {
        let mut received: Vec<Tensor> = call
            .iter()
            .map(|p| Tensor::zeros([p.len], (Kind::Float, Device::Cpu)))
            .collect();
        collective.broadcast(&mut received)?;
        for (p, t) in call.iter().zip(&received) {
            let unit = &layout.units[unit_of[p.tensor]];
            // The piece's place in the flat vector.
            let offset = layout.offsets[p.tensor] + p.start;
            if let Some((at, from, len)) = layout.mine(unit, offset, p.len) {
                tch::no_grad(|| slice.narrow(0, at, len).copy_(&t.narrow(0, from, len)));
            }
            if let Some(keep) = keep.as_mut() {
                keep(p.tensor, p.start, t);
            }
        }
    }
    Ok(slice)
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
    /// parameters), on `device`; `bucket` as `FlatLayout::for_mode`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        mode: Shard,
        bucket: i64,
        names: &[String],
        weights: &[Tensor],
        world: usize,
        rank: usize,
        mixed_precision: bool,
        device: Device,
    ) -> Self {
        let layout = FlatLayout::for_mode(mode, bucket, names, weights, world, rank);
        let slice = tch::no_grad(|| layout.slice_of(weights)).to_device(device);
        Self::from_slice(mode, layout, slice, mixed_precision, device)
    }

    /// The state of a rank whose slice of the fp32 weights is `slice` (on `device`).
    pub(crate) fn from_slice(
        mode: Shard,
        layout: FlatLayout,
        slice: Tensor,
        mixed_precision: bool,
        device: Device,
    ) -> Self {
        let grad_sums = match mode {
            Shard::Gradients | Shard::Full => {
                Some(Tensor::zeros([layout.share()], (Kind::Float, device)))
            }
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
        let sums = self
            .grad_sums
            .as_ref()
            .expect("\"gradients\" keeps slice sums");
        // Bucket by bucket: the bucket's fp32 buffer and this rank's part of its sum are
        // all a pass adds to the resident state.
        for unit in self.layout.units() {
            if unit.part == 0 {
                continue;
            }
            let input = self.layout.flatten_unit(unit, &grads, Kind::Float);
            let mut part = Tensor::zeros([unit.part], (Kind::Float, sums.device()));
            collective.reduce_scatter_sum(&input, &mut part)?;
            tch::no_grad(|| {
                let _ = sums.narrow(0, unit.in_slice, unit.part).g_add_(&part);
            });
        }
        tch::no_grad(|| {
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
        if matches!(self.mode, Shard::Gradients | Shard::Full) {
            return Ok(self
                .grad_sums
                .as_ref()
                .expect("\"gradients\" and \"full\" keep slice sums")
                .shallow_clone());
        }
        let device = self.weights.device();
        let layout = &self.layout;
        match &self.grad_sums {
            // bf16: the passes' fp32 sums, a flat vector held anyway.
            Some(sums) => layout.reduce_scatter(
                device,
                |unit| sums.narrow(0, unit.start, unit.padded),
                collective,
            ),
            None => {
                let grads: Vec<Tensor> = params.iter().map(grad_or_zeros).collect();
                layout.reduce_scatter(
                    device,
                    |unit| layout.flatten_unit(unit, &grads, Kind::Float),
                    collective,
                )
            }
        }
    }

    /// After AdamW updated this rank's slice: every rank's slice gathered into the
    /// parameters (in their kind: bf16 parameters are the masters' rounding). With
    /// `"full"` the parameters stay released (the next passes gather what they use): the
    /// units are gathered one at a time into `host` (rank 0's host copy, which publishing
    /// and checkpoints read), or only sent (the other ranks).
    pub(crate) fn gather_into_params(
        &self,
        params: &mut [Tensor],
        mut host: Option<&mut [Tensor]>,
        kind: Kind,
        collective: &mut dyn Collective,
    ) -> Result<(), CollectiveError> {
        if self.mode == Shard::Full {
            // Rank 0 alone keeps them: a gather to it, the others only send their parts.
            for unit in self.layout.units() {
                if unit.part == 0 {
                    continue;
                }
                let mine = self
                    .weights
                    .narrow(0, unit.in_slice, unit.part)
                    .to_kind(kind);
                match host.as_deref_mut() {
                    Some(host) => {
                        let mut all = Tensor::empty([unit.padded], (kind, mine.device()));
                        collective.gather_to_root(&mine, Some(&mut all))?;
                        let all = all.to_device(Device::Cpu);
                        for (j, view) in self.layout.unit_views(unit, &all) {
                            host[j] = view.copy();
                        }
                    }
                    None => collective.gather_to_root(&mine, None)?,
                }
            }
            return Ok(());
        }
        // Bucket by bucket, each copied into its parameters.
        for unit in self.layout.units() {
            let all = self
                .layout
                .all_gather_unit(unit, &self.weights, kind, collective)?;
            tch::no_grad(|| {
                for (j, view) in self.layout.unit_views(unit, &all) {
                    params[j].copy_(&view);
                }
            });
        }
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

/// Points each parameter of `unit` at its elements of the gathered unit `all` (views:
/// the unit's one buffer lives as long as any of them does).
fn set_unit(layout: &FlatLayout, unit: &Unit, all: &Tensor, params: &mut [Tensor]) {
    for (j, view) in layout.unit_views(unit, all) {
        params[j].set_data(&view);
    }
}

/// Drops each parameter's elements (`"full"`): a released parameter has shape `[0]`.
fn release_unit(unit: &Unit, params: &mut [Tensor], empty: &Tensor) {
    for &j in &unit.params {
        params[j].set_data(empty);
    }
}

/// Releases every parameter (see `release_unit`), each keeping its kind, on `device`.
pub(crate) fn release_all(params: &mut [Tensor], device: Device) {
    let kind = params.first().map_or(Kind::Float, Tensor::kind);
    let empty = Tensor::zeros([0], (kind, device));
    for p in params {
        p.set_data(&empty);
    }
}

/// One pass step of `FullGate`'s fixed order (see `tutor_policy::ParamGate`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GateOp {
    Gather(usize),
    Release(usize),
    Reduce(usize),
}

/// One collective call of a `FullGate`, run by its communication thread.
enum CommJob {
    /// All-gather unit `unit` of the weights' slices.
    Gather { unit: usize },
    /// Reduce-scatter `flat` (a unit's padded fp32 gradients) into this rank's part.
    Reduce { unit: usize, flat: Tensor },
}

/// What a job gives back: the gathered unit or this rank's part of the reduced one;
/// `Err(Some(e))` the call failed, `Err(None)` it was skipped after an earlier failure.
type CommResult = Result<Tensor, Option<CollectiveError>>;

/// The thread that owns the collective while a step's passes run: it makes the gate's
/// calls one after another, in the order the gate submits them (every rank submits the
/// same sequence), so a gather submitted ahead of its use runs while the policy computes.
struct CommThread {
    jobs: std::sync::mpsc::Sender<(CommJob, std::sync::mpsc::Sender<CommResult>)>,
    thread: std::thread::JoinHandle<Box<dyn Collective>>,
}

impl CommThread {
    fn start(
        layout: FlatLayout,
        weights: Tensor,
        kind: Kind,
        mut collective: Box<dyn Collective>,
    ) -> Self {
        let (jobs, queue) =
            std::sync::mpsc::channel::<(CommJob, std::sync::mpsc::Sender<CommResult>)>();
        let thread = std::thread::Builder::new()
            .name("tutor-full-shard-comm".into())
            .spawn(move || {
                let mut failed = false;
                for (job, reply) in queue {
                    let result = if failed {
                        Err(None)
                    } else {
                        tch::no_grad(|| match job {
                            CommJob::Gather { unit } => layout
                                .all_gather_unit(
                                    &layout.units()[unit],
                                    &weights,
                                    kind,
                                    &mut *collective,
                                )
                                .map_err(Some),
                            CommJob::Reduce { unit, flat } => {
                                let unit = &layout.units()[unit];
                                let mut mine =
                                    Tensor::zeros([unit.part], (Kind::Float, flat.device()));
                                collective
                                    .reduce_scatter_sum(&flat, &mut mine)
                                    .map(|()| mine)
                                    .map_err(Some)
                            }
                        })
                    };
                    failed |= result.is_err();
                    // The gate may have stopped waiting (it is closing): nothing to do.
                    let _ = reply.send(result);
                }
                collective
            })
            .expect("starting the shard's communication thread");
        Self { jobs, thread }
    }

    fn submit(&self, job: CommJob) -> std::sync::mpsc::Receiver<CommResult> {
        let (reply, answer) = std::sync::mpsc::channel();
        // The thread lives until `finish`: a send cannot fail before.
        let _ = self.jobs.send((job, reply));
        answer
    }

    /// Waits for the jobs submitted so far and takes the collective back.
    fn finish(self) -> Box<dyn Collective> {
        drop(self.jobs);
        match self.thread.join() {
            Ok(c) => c,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

/// `[learner] shard = "full"` (ZeRO-3) during a step's passes: the parameters are
/// released (shape `[0]`) except the units a pass is using, each gathered from the
/// ranks' fp32 slices when the policy asks (`tutor_policy::ParamGate`) and released after
/// its forward or its backward; each unit's gradients are reduce-scattered into this
/// rank's slice of the sums as soon as its backward ends. The collective calls run on a
/// thread of their own (`CommThread`), in the order the gate submits them; with
/// `[learner] prefetch` the gather of the next unit is submitted as soon as one is
/// taken, so it runs while the policy computes (one more unit in memory), and a unit's
/// reduce-scatter runs while the next unit computes (its part is added once a later
/// gather returns, at the latest when the pass ends). Every rank submits the same
/// calls in the same order: a rank short of a batch, or whose loss did not reach the
/// model, completes the pass with zeros (`complete_pass`). A failed collective is kept
/// (`failed`) and every later one skipped (the units then hold zeros, so the pass runs
/// out harmlessly); the step then fails with it.
pub(crate) struct FullGate {
    layout: FlatLayout,
    params: Vec<Tensor>,
    /// This rank's fp32 slice of the step's gradient sums (a handle sharing `Sharded`'s
    /// storage).
    sums: Tensor,
    kind: Kind,
    device: Device,
    empty: Tensor,
    comm: Option<CommThread>,
    prefetch: bool,
    order: Vec<GateOp>,
    next: usize,
    /// Gathers submitted and not yet taken, by their position in `order`.
    gathers: std::collections::HashMap<usize, std::sync::mpsc::Receiver<CommResult>>,
    /// Reduce-scatters submitted and not yet added into `sums`.
    reduces: Vec<(usize, std::sync::mpsc::Receiver<CommResult>)>,
    pub(crate) failed: Option<(&'static str, CollectiveError)>,
    bytes: u64,
    /// The most parameter bytes present at once (gathered or being gathered).
    pub(crate) peak_bytes: u64,
}

impl FullGate {
    /// Releases every parameter: from here on a unit is present only while a pass uses it
    /// (and, with `prefetch`, while the one before it computes).
    pub(crate) fn open(
        sharded: &Sharded,
        params: &[Tensor],
        kind: Kind,
        collective: Box<dyn Collective>,
        prefetch: bool,
    ) -> Self {
        let units = sharded.layout.units().len();
        let mut order = vec![GateOp::Gather(0)];
        for u in 1..units {
            order.extend([GateOp::Gather(u), GateOp::Release(u)]);
        }
        for u in (1..units).rev() {
            order.extend([GateOp::Gather(u), GateOp::Reduce(u)]);
        }
        order.push(GateOp::Reduce(0));
        let device = sharded.weights.device();
        let empty = Tensor::zeros([0], (kind, device));
        let mut params: Vec<Tensor> = params.iter().map(Tensor::shallow_clone).collect();
        release_all(&mut params, device);
        let comm = CommThread::start(
            sharded.layout.clone(),
            sharded.weights.shallow_clone(),
            kind,
            collective,
        );
        Self {
            layout: sharded.layout.clone(),
            params,
            sums: sharded
                .grad_sums
                .as_ref()
                .expect("\"full\" keeps slice sums")
                .shallow_clone(),
            kind,
            device,
            empty,
            comm: Some(comm),
            prefetch,
            order,
            next: 0,
            gathers: Default::default(),
            reduces: Vec::new(),
            failed: None,
            bytes: 0,
            peak_bytes: 0,
        }
    }

    /// Runs what is left of the current pass's order with zero gradients (a rank without
    /// a batch this round, or a loss that did not reach the model), waits for the pass's
    /// reduce-scatters, and starts the next pass.
    pub(crate) fn complete_pass(&mut self) {
        while self.next < self.order.len() {
            let op = self.order[self.next];
            self.next += 1;
            self.run(op, None);
        }
        self.drain_reduces();
        self.next = 0;
    }

    /// Ends the passes: the collective back (after every submitted call), the first
    /// failure and the most parameter bytes present at once.
    #[allow(clippy::type_complexity)]
    pub(crate) fn finish(
        mut self,
    ) -> (
        Box<dyn Collective>,
        Option<(&'static str, CollectiveError)>,
        u64,
    ) {
        self.drain_reduces();
        self.gathers.clear();
        let comm = self.comm.take().expect("the gate finishes once");
        (comm.finish(), self.failed.take(), self.peak_bytes)
    }

    fn expect(&mut self, op: GateOp) {
        let want = self.order.get(self.next).copied();
        assert_eq!(
            want,
            Some(op),
            "shard = \"full\": a training pass used the model out of the order the ranks \
             agree on (one checkpointed forward and its backward per pass)"
        );
        self.next += 1;
    }

    fn run(&mut self, op: GateOp, grads: Option<&[Tensor]>) {
        tch::no_grad(|| match op {
            GateOp::Gather(u) => self.gather(u),
            GateOp::Release(u) => self.release(u),
            GateOp::Reduce(u) => {
                self.reduce(u, grads);
                self.release(u);
            }
        })
    }

    fn comm(&self) -> &CommThread {
        self.comm.as_ref().expect("the gate is open")
    }

    fn unit_bytes(&self, u: usize) -> u64 {
        self.layout.units()[u].padded as u64 * self.kind.elt_size_in_bytes() as u64
    }

    /// Submits the gather at `order[at]` unless it is submitted already; its buffer
    /// counts from here.
    fn submit_gather(&mut self, at: usize) {
        if self.gathers.contains_key(&at) {
            return;
        }
        let GateOp::Gather(u) = self.order[at] else {
            unreachable!("only gathers are submitted ahead")
        };
        let answer = self.comm().submit(CommJob::Gather { unit: u });
        self.gathers.insert(at, answer);
        self.bytes += self.unit_bytes(u);
        self.peak_bytes = self.peak_bytes.max(self.bytes);
    }

    /// The gather at `order[self.next - 1]`: submitted now unless it was ahead of time,
    /// then (with `prefetch`) the next gather of the pass submitted, then waited for.
    fn gather(&mut self, u: usize) {
        let at = self.next - 1;
        self.submit_gather(at);
        if self.prefetch {
            if let Some(ahead) =
                (at + 1..self.order.len()).find(|&j| matches!(self.order[j], GateOp::Gather(_)))
            {
                self.submit_gather(ahead);
            }
        }
        let padded = self.layout.units()[u].padded;
        let (kind, device) = (self.kind, self.device);
        let zeros = || Tensor::zeros([padded], (kind, device));
        let answer = self.gathers.remove(&at).expect("submitted above");
        let all = match answer.recv() {
            Ok(Ok(all)) => all,
            Ok(Err(Some(e))) => {
                self.failed
                    .get_or_insert(("all-gathering a layer's parameters", e));
                zeros()
            }
            Ok(Err(None)) => zeros(),
            Err(_) => {
                self.comm_stopped();
                zeros()
            }
        };
        let unit = &self.layout.units()[u];
        set_unit(&self.layout, unit, &all, &mut self.params);
        // The thread runs its jobs in order: the reduce-scatters submitted before this
        // gather are done (with prefetch a reduce submitted after it is usually added
        // at the next gather); their parts go into the sums now rather than wait.
        self.add_finished_reduces();
    }

    /// The communication thread ended before answering (it panicked): the step fails.
    fn comm_stopped(&mut self) {
        self.failed.get_or_insert((
            "running the shard's collective calls",
            CollectiveError::Setup("the communication thread stopped (it panicked)".into()),
        ));
    }

    /// Adds into the sums the reduce-scatters that are done, in submission order,
    /// stopping at the first still running.
    fn add_finished_reduces(&mut self) {
        while let Some((u, answer)) = self.reduces.first() {
            let result = match answer.try_recv() {
                Ok(result) => Ok(result),
                Err(std::sync::mpsc::TryRecvError::Empty) => return,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(()),
            };
            let u = *u;
            self.reduces.remove(0);
            self.add_reduced(u, result);
        }
    }

    /// One reduce-scatter's answer (`Err(())`: the thread stopped) into the sums.
    fn add_reduced(&mut self, u: usize, result: Result<CommResult, ()>) {
        let unit = &self.layout.units()[u];
        match result {
            Ok(Ok(mine)) => tch::no_grad(|| {
                let _ = self.sums.narrow(0, unit.in_slice, unit.part).g_add_(&mine);
            }),
            Ok(Err(Some(e))) => {
                self.failed
                    .get_or_insert(("reduce-scattering a layer's gradients", e));
            }
            Ok(Err(None)) => {}
            Err(()) => self.comm_stopped(),
        }
    }

    fn release(&mut self, u: usize) {
        let unit = &self.layout.units()[u];
        release_unit(unit, &mut self.params, &self.empty);
        self.bytes = self.bytes.saturating_sub(self.unit_bytes(u));
    }

    /// Unit `u`'s gradients (`None`: zeros) reduce-scattered into this rank's sums:
    /// submitted now, added when it is done (at once without `prefetch`).
    fn reduce(&mut self, u: usize, grads: Option<&[Tensor]>) {
        let unit = &self.layout.units()[u];
        let flat = Tensor::zeros([unit.padded], (Kind::Float, self.device));
        if let Some(grads) = grads {
            for (g, (_, mut view)) in grads.iter().zip(self.layout.unit_views(unit, &flat)) {
                view.copy_(g);
            }
        }
        if unit.part == 0 {
            return;
        }
        let answer = self.comm().submit(CommJob::Reduce { unit: u, flat });
        self.reduces.push((u, answer));
        if !self.prefetch {
            self.drain_reduces();
        }
    }

    /// Waits for the submitted reduce-scatters and adds each into the sums.
    fn drain_reduces(&mut self) {
        for (u, answer) in std::mem::take(&mut self.reduces) {
            let result = answer.recv().map_err(|_| ());
            self.add_reduced(u, result);
        }
    }
}

/// `FullGate` shared between the trainer (which takes it back after the passes) and the
/// policy (which calls it during them).
pub(crate) struct GateHandle(pub(crate) std::sync::Arc<std::sync::Mutex<FullGate>>);

impl tutor_policy::ParamGate for GateHandle {
    fn gather(&mut self, unit: usize) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.expect(GateOp::Gather(unit));
        g.run(GateOp::Gather(unit), None);
    }

    fn release(&mut self, unit: usize) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.expect(GateOp::Release(unit));
        g.run(GateOp::Release(unit), None);
    }

    fn reduce(&mut self, unit: usize, grads: &[Tensor]) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.expect(GateOp::Reduce(unit));
        g.run(GateOp::Reduce(unit), Some(grads));
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
        // Units: each padded on its own, a rank's slice its part of each, in unit order;
        // one all-gather per unit (rank-major parts) rebuilds the unit.
        let units = vec![vec![1], vec![0]];
        for world in 1..=4 {
            let layouts: Vec<FlatLayout> = (0..world)
                .map(|r| FlatLayout::with_units(&ps, &units, world, r))
                .collect();
            let flat = layouts[0].flatten(&ps, Kind::Float);
            let slices: Vec<Tensor> = layouts.iter().map(|l| l.slice_of(&ps)).collect();
            for (u, unit) in layouts[0].units().iter().enumerate() {
                assert_eq!(unit.padded % world as i64, 0);
                let parts: Vec<Tensor> = slices
                    .iter()
                    .map(|s| s.narrow(0, unit.in_slice, unit.part))
                    .collect();
                let gathered = Tensor::cat(&parts, 0);
                assert!(
                    gathered.equal(&flat.narrow(0, unit.start, unit.padded)),
                    "world {world} unit {u}"
                );
            }
            let back = layouts[0].split(&flat);
            for (a, b) in back.iter().zip(&ps) {
                assert!(a.equal(b), "world {world}");
            }
        }
        // 5 + 6 elements over 4 ranks: parts of 2 each, padding inside the slice.
        let l = FlatLayout::with_units(&ps, &units, 4, 3);
        assert_eq!((l.share(), l.padded()), (4, 16));
        let last: Vec<f32> = Vec::try_from(l.slice_of(&ps)).unwrap();
        assert_eq!(last, vec![0.0, 0.0, 0.0, 0.0]);
        let first: Vec<f32> =
            Vec::try_from(FlatLayout::with_units(&ps, &units, 4, 0).slice_of(&ps)).unwrap();
        assert_eq!(first, vec![100.0, 101.0, 0.0, 1.0]);

        // 11 elements over 4 ranks: slices of 3, one zero of padding at the end.
        let l = FlatLayout::new(&ps, 4, 3);
        assert_eq!((l.share(), l.padded()), (3, 12));
        let last: Vec<f32> = Vec::try_from(l.slice_of(&ps)).unwrap();
        assert_eq!(last, vec![103.0, 104.0, 0.0]);
    }

    /// A lone rank whose gathers and reduce-scatters fail from call `fail_at` (0-based)
    /// on; `calls` counts every one attempted (shared, so the test sees it).
    struct FailingAt {
        inner: tutor_collective::CpuCollective,
        calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        fail_at: usize,
    }

    impl FailingAt {
        fn tick(&mut self) -> Result<(), CollectiveError> {
            let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            if n > self.fail_at {
                return Err(CollectiveError::Setup(format!("injected failure {n}")));
            }
            Ok(())
        }
    }

    impl Collective for FailingAt {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            1
        }
        fn all_reduce_sum(&mut self, t: &mut [Tensor]) -> Result<(), CollectiveError> {
            self.inner.all_reduce_sum(t)
        }
        fn broadcast(&mut self, t: &mut [Tensor]) -> Result<(), CollectiveError> {
            self.inner.broadcast(t)
        }
        fn broadcast_bytes_max(
            &mut self,
            d: &mut Vec<u8>,
            m: usize,
        ) -> Result<(), CollectiveError> {
            self.inner.broadcast_bytes_max(d, m)
        }
        fn barrier(&mut self) -> Result<(), CollectiveError> {
            Ok(())
        }
        fn reduce_scatter_sum(
            &mut self,
            i: &Tensor,
            o: &mut Tensor,
        ) -> Result<(), CollectiveError> {
            self.tick()?;
            self.inner.reduce_scatter_sum(i, o)
        }
        fn all_gather(&mut self, i: &Tensor, o: &mut Tensor) -> Result<(), CollectiveError> {
            self.tick()?;
            self.inner.all_gather(i, o)
        }
    }

    /// `"full"`'s gate on its communication thread, with and without prefetching: with
    /// no failure, two passes' reduced gradients are in the sums when the passes end;
    /// when a call fails (a gather, or a reduce-scatter in flight), every later call is
    /// skipped (exactly `fail_at + 1` attempted), the pass runs out on zeros without
    /// hanging, the first failure is kept naming what failed, and the collective the
    /// gate was lent comes back.
    #[test]
    fn a_failing_collective_ends_the_full_gates_pass_and_the_collective_comes_back() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tutor_policy::ParamGate;
        // Unit 0 and two layers: three units of two parameters each.
        let ps: Vec<Tensor> = (0..6)
            .map(|i| Tensor::ones([4], (Kind::Float, Device::Cpu)) * (i + 1) as f64)
            .collect();
        let names: Vec<String> = [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.layers.0.a",
            "model.layers.0.b",
            "model.layers.1.a",
            "model.layers.1.b",
        ]
        .iter()
        .map(|n| n.to_string())
        .collect();
        let mut sharded = Sharded::new(Shard::Full, 1 << 20, &names, &ps, 1, 0, false, Device::Cpu);
        assert_eq!(sharded.layout.units().len(), 3);
        let layer2 = sharded.layout.units()[2].clone();
        let grads = || -> Vec<Tensor> {
            (0..2)
                .map(|_| Tensor::ones([4], (Kind::Float, Device::Cpu)))
                .collect()
        };
        // A pass makes 8 calls: gathers of units 0, 1, 2, then 2 and 1 again, and the
        // reduce-scatters of units 2, 1, 0; the 7th is unit 1's reduce-scatter (with or
        // without prefetching), the 2nd unit 1's gather.
        for (prefetch, fail_at, passes) in [
            (true, usize::MAX, 2),
            (false, usize::MAX, 2),
            (true, 1, 1),
            (false, 1, 1),
            (true, 6, 1),
            (false, 6, 1),
        ] {
            sharded.zero_grad_sums();
            let calls = std::sync::Arc::new(AtomicUsize::new(0));
            let c = FailingAt {
                inner: tutor_collective::CpuCollective::solo(),
                calls: calls.clone(),
                fail_at,
            };
            let gate = std::sync::Arc::new(std::sync::Mutex::new(FullGate::open(
                &sharded,
                &ps,
                Kind::Float,
                Box::new(c),
                prefetch,
            )));
            for _ in 0..passes {
                // The forward, then the backward of layer 2 alone (unit 2 was the last
                // layer); the rest of the pass is completed with zeros.
                let mut handle = GateHandle(gate.clone());
                handle.gather(0);
                for u in 1..3 {
                    handle.gather(u);
                    handle.release(u);
                }
                handle.gather(2);
                handle.reduce(2, &grads());
                gate.lock().unwrap().complete_pass();
            }
            let gate = std::sync::Arc::try_unwrap(gate)
                .ok()
                .unwrap()
                .into_inner()
                .unwrap();
            let sums: Vec<f32> = Vec::try_from(gate.sums.shallow_clone()).unwrap();
            let (mut back, failed, _) = gate.finish();
            let case = format!("prefetch {prefetch}, failing at {fail_at}");
            // Layer 2's part holds what its reduce-scatters added (ones each pass).
            let added = if fail_at == 1 { 0.0 } else { passes as f32 };
            let want: Vec<f32> = (0..sums.len() as i64)
                .map(|i| {
                    let inside = i >= layer2.in_slice && i < layer2.in_slice + layer2.part;
                    if inside {
                        added
                    } else {
                        0.0
                    }
                })
                .collect();
            assert_eq!(sums, want, "{case}");
            let made = calls.load(Ordering::SeqCst);
            match fail_at {
                usize::MAX => {
                    assert!(failed.is_none(), "{case}");
                    assert_eq!(made, 8 * passes, "{case}");
                }
                _ => {
                    assert_eq!(made, fail_at + 1, "{case}: later calls are skipped");
                    let (during, e) = failed.expect("the failure is kept");
                    assert!(
                        e.to_string().contains(&format!("injected failure {made}")),
                        "{e}"
                    );
                    let want = if fail_at == 1 {
                        "all-gathering a layer's parameters"
                    } else {
                        "reduce-scattering a layer's gradients"
                    };
                    assert_eq!(during, want, "{case}");
                }
            }
            // The collective that comes back is the one lent (its counter moves).
            let one = Tensor::ones([1], (Kind::Float, Device::Cpu));
            let _ = back.all_gather(&one, &mut one.zeros_like());
            assert_eq!(calls.load(Ordering::SeqCst), made + 1, "{case}");
        }
    }

    /// Outside `"full"`, units are buckets of consecutive parameters of at most `bucket`
    /// elements each, a larger parameter alone; `flatten_unit` is that unit of the flat
    /// vector.
    #[test]
    fn buckets_group_consecutive_parameters_up_to_their_size() {
        let sizes = [3i64, 4, 2, 9, 1, 1, 5];
        let ps: Vec<Tensor> = sizes
            .iter()
            .scan(0.0, |at, &n| {
                let t = Tensor::arange(n, (Kind::Float, Device::Cpu)) + *at;
                *at += 100.0;
                Some(t)
            })
            .collect();
        let names: Vec<String> = (0..ps.len()).map(|i| format!("p{i}")).collect();
        let groups = |bucket: i64| -> Vec<Vec<usize>> {
            FlatLayout::for_mode(Shard::Gradients, bucket, &names, &ps, 3, 0)
                .units()
                .iter()
                .map(|u| u.params.clone())
                .collect()
        };
        assert_eq!(
            groups(1 << 24),
            vec![vec![0, 1, 2, 3, 4, 5, 6]],
            "one bucket"
        );
        assert_eq!(
            groups(7),
            vec![vec![0, 1], vec![2], vec![3], vec![4, 5, 6]],
            "9 > 7 is a bucket alone"
        );
        assert_eq!(groups(1).len(), sizes.len());
        for world in 1..=4 {
            let layouts: Vec<FlatLayout> = (0..world)
                .map(|r| FlatLayout::for_mode(Shard::Optimizer, 7, &names, &ps, world, r))
                .collect();
            let flat = layouts[0].flatten(&ps, Kind::Float);
            let slices: Vec<Tensor> = layouts.iter().map(|l| l.slice_of(&ps)).collect();
            for unit in layouts[0].units() {
                assert!(unit.padded <= 9 + world as i64, "{}", unit.padded);
                let whole = layouts[0].flatten_unit(unit, &ps, Kind::Float);
                assert!(whole.equal(&flat.narrow(0, unit.start, unit.padded)));
                let parts: Vec<Tensor> = slices
                    .iter()
                    .map(|s| s.narrow(0, unit.in_slice, unit.part))
                    .collect();
                assert!(Tensor::cat(&parts, 0).equal(&whole), "world {world}");
            }
        }
    }

    /// A joining rank's slice, received bucket by bucket as rank 0 broadcasts the whole
    /// weights (`broadcast_in_buckets`), is the slice `slice_of` cuts from the whole, in
    /// every mode (`"full"`'s units are not in parameter order), for buckets smaller and
    /// larger than a parameter (a larger one comes in runs of a bucket); `keep` gets every
    /// parameter's pieces once, in order, with rank 0's values; no call moves more than a
    /// bucket.
    #[test]
    fn a_slice_received_bucket_by_bucket_is_the_slice_of_the_whole() {
        use tutor_collective::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
        let sizes = [3i64, 4, 2, 9, 1, 1, 5];
        let names: Vec<String> = [
            "lm_head.weight",
            "model.embed_tokens.weight",
            "model.layers.0.a",
            "model.layers.0.b",
            "model.layers.1.a",
            "model.layers.1.b",
            "model.norm.weight",
        ]
        .map(String::from)
        .to_vec();
        // Tensors are not shared between threads: each makes its own.
        let make = || -> Vec<Tensor> {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    Tensor::arange(n, (Kind::Float, Device::Cpu)) + 100.0 * i as f64 + 1.0
                })
                .collect()
        };
        let ps = make();
        let piece = |tensor, start, len| Piece { tensor, start, len };
        assert_eq!(
            broadcast_calls(&sizes, 7),
            vec![
                vec![piece(0, 0, 3), piece(1, 0, 4)],
                vec![piece(2, 0, 2)],
                vec![piece(3, 0, 7)],
                vec![piece(3, 7, 2)],
                vec![piece(4, 0, 1), piece(5, 0, 1), piece(6, 0, 5)],
            ]
        );
        let world = 3;
        let timeouts = CpuCollectiveTimeouts {
            connect: std::time::Duration::from_secs(20),
            io: std::time::Duration::from_secs(20),
        };
        for mode in [Shard::Optimizer, Shard::Gradients, Shard::Full] {
            for bucket in [1, 5, 7, 1 << 20] {
                let case = format!("{} bucket {bucket}", mode.name());
                for call in broadcast_calls(&sizes, bucket) {
                    assert!(call.iter().map(|p| p.len).sum::<i64>() <= bucket, "{case}");
                }
                let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
                let addr = rdv.local_addr();
                std::thread::scope(|s| {
                    let joiners: Vec<_> = (1..world)
                        .map(|r| {
                            let (names, make) = (&names, &make);
                            s.spawn(move || {
                                let ps = make();
                                let mut c =
                                    CpuCollective::connect(addr, r, world, timeouts).unwrap();
                                let shapes: Vec<Vec<i64>> = ps.iter().map(Tensor::size).collect();
                                let layout =
                                    FlatLayout::for_shapes(mode, bucket, names, &shapes, world, r);
                                // Each parameter put together from its pieces, in order.
                                let mut kept: Vec<(usize, Vec<f32>)> = Vec::new();
                                let mut keep = |j: usize, start: i64, t: &Tensor| {
                                    if start == 0 {
                                        kept.push((j, Vec::new()));
                                    }
                                    let (k, values) = kept.last_mut().unwrap();
                                    assert_eq!((*k, values.len() as i64), (j, start));
                                    values.extend(Vec::<f32>::try_from(t).unwrap());
                                };
                                let slice = receive_slice_in_buckets(
                                    &mut c,
                                    &layout,
                                    bucket,
                                    Some(&mut keep),
                                )
                                .unwrap();
                                (layout.slice_of(&ps), slice, kept)
                            })
                        })
                        .collect();
                    let mut c = rdv.accept(world, timeouts).unwrap();
                    let mut sent: Vec<Tensor> = ps.iter().map(Tensor::copy).collect();
                    crate::trainer::broadcast_in_buckets(&mut c, &mut sent, bucket).unwrap();
                    for h in joiners {
                        let (want, slice, kept) = h.join().unwrap();
                        assert!(slice.equal(&want), "{case}: {slice:?} != {want:?}");
                        assert_eq!(kept.len(), ps.len(), "{case}");
                        for (i, (j, values)) in kept.iter().enumerate() {
                            assert_eq!(*j, i, "{case}");
                            let want = Vec::<f32>::try_from(ps[i].reshape([-1])).unwrap();
                            assert_eq!(values, &want, "{case}: parameter {i}");
                        }
                    }
                });
            }
        }
    }
}
