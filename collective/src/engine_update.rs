//! Weights into an inference engine over the CPU collective: the data plane of SGLang's
//! `update_weights_from_distributed`, as a rollout worker (rank 0, the sender) and
//! `tutor serve` (a receiving rank) speak it.
//!
//! The control plane is HTTP (`/init_weights_update_group`, then one
//! `/update_weights_from_distributed` per version, naming every tensor's name, dtype and
//! shape in sending order). The data plane is this module: the tensors of one safetensors
//! file, in the order of their bytes in the file, broadcast in buckets of consecutive
//! tensors of at most [`BUCKET_BYTES`] (a larger tensor is a bucket of its own). A bucket
//! is one contiguous slice of the file (copied once into the message, nothing to
//! assemble); the receiver writes each bucket into place in a safetensors file of its own in memory,
//! whose header it built from the announced names, dtypes and shapes before the first byte
//! arrived, and refuses a bucket of any other length than announced.
//!
//! Backend name in the control plane: [`BACKEND`]. SGLang's own servers speak `nccl`
//! (torch.distributed's TCP store and NCCL), which this module does not: against them,
//! weights go through `update_weights_from_disk`.

use safetensors::{Dtype, SafeTensors};

use crate::{Collective, CollectiveError};

/// The `backend` a weight-update group over this data plane is initialised with.
pub const BACKEND: &str = "tutor-cpu";

/// Prefixed to a weight-update group's name where its hello key is derived from the
/// engine's API key (`CollectiveSecret::from_token(key, SECRET_CONTEXT + group)`): no such
/// key is ever that of a run's group.
pub const SECRET_CONTEXT: &str = "engine-update/";

/// Most bytes of one broadcast: consecutive tensors are sent together up to this size.
pub const BUCKET_BYTES: usize = 64 << 20;

/// One tensor as the control plane announces it: `dtype` in PyTorch's spelling without
/// `torch.` (`bfloat16`, `float32`, ...), as SGLang's `update_weights_from_distributed`
/// takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
}

/// (PyTorch's name, safetensors' code, bytes per element) of each dtype sent.
const DTYPES: &[(&str, &str, usize, Dtype)] = &[
    ("bfloat16", "BF16", 2, Dtype::BF16),
    ("float16", "F16", 2, Dtype::F16),
    ("float32", "F32", 4, Dtype::F32),
    ("float64", "F64", 8, Dtype::F64),
    ("int64", "I64", 8, Dtype::I64),
    ("int32", "I32", 4, Dtype::I32),
    ("int16", "I16", 2, Dtype::I16),
    ("int8", "I8", 1, Dtype::I8),
    ("uint8", "U8", 1, Dtype::U8),
    ("bool", "BOOL", 1, Dtype::BOOL),
];

fn bad(message: String) -> CollectiveError {
    CollectiveError::Setup(message)
}

impl TensorMeta {
    /// The tensor's size in bytes; an unknown dtype or an overflowing shape is an error
    /// naming the tensor.
    pub fn bytes(&self) -> Result<usize, CollectiveError> {
        let size = DTYPES
            .iter()
            .find(|d| d.0 == self.dtype)
            .map(|d| d.2)
            .ok_or_else(|| {
                bad(format!(
                    "tensor {:?}: dtype {:?} is not one of {}",
                    self.name,
                    self.dtype,
                    DTYPES.iter().map(|d| d.0).collect::<Vec<_>>().join(", ")
                ))
            })?;
        self.shape
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                bad(format!(
                    "tensor {:?}: shape {:?} overflows",
                    self.name, self.shape
                ))
            })
    }
}

/// The tensors of the safetensors file `file`, in the order of their bytes (the sending
/// order), with where their bytes are in `file`.
fn layout(file: &[u8]) -> Result<Vec<(TensorMeta, std::ops::Range<usize>)>, CollectiveError> {
    let st = SafeTensors::deserialize(file)
        .map_err(|e| bad(format!("not a safetensors file: {e:?}")))?;
    let base = file.as_ptr() as usize;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = DTYPES
            .iter()
            .find(|d| d.3 == view.dtype())
            .map(|d| d.0)
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name:?}: dtype {:?} cannot be sent",
                    view.dtype()
                ))
            })?;
        let start = view.data().as_ptr() as usize - base;
        out.push((
            TensorMeta {
                name,
                dtype: dtype.to_string(),
                shape: view.shape().to_vec(),
            },
            start..start + view.data().len(),
        ));
    }
    out.sort_by_key(|(_, r)| r.start);
    Ok(out)
}

/// What [`send`] sends for `file`, in order: the control plane announces exactly this.
pub fn tensors_of(file: &[u8]) -> Result<Vec<TensorMeta>, CollectiveError> {
    Ok(layout(file)?.into_iter().map(|(m, _)| m).collect())
}

/// The buckets of tensors of the given sizes: ranges of tensor indices, each at most
/// [`BUCKET_BYTES`] unless one tensor alone is larger. Sender and receiver split alike.
fn buckets(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes + s > BUCKET_BYTES {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += s;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// Rank 0: broadcasts the tensors of the safetensors file `file` in the order
/// [`tensors_of`] gives. Returns the bytes sent.
pub fn send(c: &mut dyn Collective, file: &[u8]) -> Result<usize, CollectiveError> {
    if c.rank() != 0 {
        return Err(bad(format!(
            "rank {} cannot send weights: rank 0 sends",
            c.rank()
        )));
    }
    let layout = layout(file)?;
    let sizes: Vec<usize> = layout.iter().map(|(_, r)| r.len()).collect();
    let mut sent = 0;
    for b in buckets(&sizes) {
        // Consecutive tensors are consecutive bytes of the file (safetensors has no gaps).
        let range = layout[b.start].1.start..layout[b.end - 1].1.end;
        let mut data = file[range].to_vec();
        let len = data.len();
        c.broadcast_bytes_max(&mut data, len)?;
        sent += len;
    }
    Ok(sent)
}

/// A receiving rank: the tensors `metas` announces, in that order, as one safetensors
/// file in memory that an engine loads as it loads a file. Refused before anything is
/// received: an empty or doubled name, an unknown dtype, or more than `max_bytes` in all.
/// A bucket of another length than announced is an error.
pub fn receive(
    c: &mut dyn Collective,
    metas: &[TensorMeta],
    max_bytes: usize,
) -> Result<Vec<u8>, CollectiveError> {
    if c.rank() == 0 {
        return Err(bad("rank 0 sends weights; it cannot receive them".into()));
    }
    let (mut header, sizes) = header_of(metas, max_bytes)?;
    let total: usize = sizes.iter().sum();
    let pad = (8 - header.len() % 8) % 8;
    header.resize(header.len() + pad, b' ');
    // Exactly the file's size: growing past it would copy everything received so far.
    let mut file = Vec::with_capacity(8 + header.len() + total);
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(&header);
    for b in buckets(&sizes) {
        let want: usize = sizes[b.clone()].iter().sum();
        let mut data = Vec::new();
        c.broadcast_bytes_max(&mut data, want)?;
        if data.len() != want {
            return Err(bad(format!(
                "rank 0 sent {} bytes for tensors {:?}..={:?}, announced as {want}",
                data.len(),
                metas[b.start].name,
                metas[b.end - 1].name
            )));
        }
        file.extend_from_slice(&data);
    }
    Ok(file)
}

/// The safetensors header of `metas` laid out in order, and each tensor's bytes.
fn header_of(
    metas: &[TensorMeta],
    max_bytes: usize,
) -> Result<(Vec<u8>, Vec<usize>), CollectiveError> {
    let mut seen = std::collections::HashSet::new();
    let mut header = serde_json::Map::new();
    let mut sizes = Vec::with_capacity(metas.len());
    let mut offset = 0usize;
    for m in metas {
        if m.name.is_empty() || m.name == "__metadata__" || !seen.insert(m.name.as_str()) {
            return Err(bad(format!(
                "tensor name {:?} is empty, reserved or doubled",
                m.name
            )));
        }
        let n = m.bytes()?;
        let end = offset
            .checked_add(n)
            .filter(|&e| e <= max_bytes)
            .ok_or_else(|| {
                bad(format!(
                    "the tensors announced come to more than the {max_bytes} bytes this engine's \
                     model can take (at {:?})",
                    m.name
                ))
            })?;
        let code = DTYPES
            .iter()
            .find(|d| d.0 == m.dtype)
            .map(|d| d.1)
            .unwrap_or("F32");
        header.insert(
            m.name.clone(),
            serde_json::json!({"dtype": code, "shape": m.shape, "data_offsets": [offset, end]}),
        );
        sizes.push(n);
        offset = end;
    }
    let header = serde_json::to_vec(&header).map_err(|e| bad(format!("header: {e}")))?;
    Ok((header, sizes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};
    use std::time::Duration;
    use tch::{Device, Kind, Tensor};

    fn pair() -> (CpuCollective, CpuCollective) {
        let rdv = CpuRendezvous::bind("127.0.0.1:0").unwrap();
        let addr = rdv.local_addr();
        let t = CpuCollectiveTimeouts {
            connect: Duration::from_secs(20),
            io: Duration::from_secs(20),
        };
        let joiner = std::thread::spawn(move || CpuCollective::connect(addr, 1, 2, t).unwrap());
        let root = rdv.accept(2, t).unwrap();
        (root, joiner.join().unwrap())
    }

    fn file(tensors: &[(&str, Tensor)]) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        Tensor::write_safetensors(tensors, &path).unwrap();
        std::fs::read(path).unwrap()
    }

    #[test]
    fn buckets_hold_consecutive_tensors_up_to_the_limit() {
        let big = BUCKET_BYTES;
        assert_eq!(buckets(&[]), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(buckets(&[10, 20, 30]), vec![0..3]);
        assert_eq!(buckets(&[big / 2, big / 2, 1]), vec![0..2, 2..3]);
        assert_eq!(buckets(&[1, big * 3, 1]), vec![0..1, 1..2, 2..3]);
    }

    #[test]
    fn the_receiver_gets_every_tensor_bit_for_bit_in_a_file_it_can_load() {
        let a = Tensor::randn([3, 5], (Kind::BFloat16, Device::Cpu));
        let b = Tensor::randn([7], (Kind::Float, Device::Cpu));
        // More than one bucket: a tensor larger than a bucket between two small ones.
        let big = Tensor::randn(
            [(BUCKET_BYTES / 2 + 1) as i64],
            (Kind::BFloat16, Device::Cpu),
        );
        let c = Tensor::arange(4, (Kind::Int64, Device::Cpu));
        let bytes = file(&[
            ("z.a", a.shallow_clone()),
            ("b", b.shallow_clone()),
            ("big", big.shallow_clone()),
            ("c", c.shallow_clone()),
        ]);
        let metas = tensors_of(&bytes).unwrap();
        assert_eq!(metas.len(), 4);
        let (mut root, mut other) = pair();
        let m2 = metas.clone();
        let rx = std::thread::spawn(move || receive(&mut other, &m2, usize::MAX).unwrap());
        let sent = send(&mut root, &bytes).unwrap();
        let got = rx.join().unwrap();
        assert_eq!(
            sent,
            metas.iter().map(|m| m.bytes().unwrap()).sum::<usize>()
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("got.safetensors");
        std::fs::write(&path, &got).unwrap();
        let loaded: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&path)
            .unwrap()
            .into_iter()
            .collect();
        for (name, t) in [("z.a", &a), ("b", &b), ("big", &big), ("c", &c)] {
            let l = &loaded[name];
            assert_eq!(l.kind(), t.kind(), "{name}");
            assert!(l.equal(t), "{name} differs");
        }
    }

    #[test]
    fn announcements_that_cannot_be_right_are_refused_before_receiving() {
        let m = |name: &str, dtype: &str, shape: &[usize]| TensorMeta {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.to_vec(),
        };
        let cases = [
            (
                vec![m("a", "float32", &[2]), m("a", "float32", &[2])],
                "doubled",
            ),
            (vec![m("", "float32", &[2])], "empty"),
            (vec![m("a", "complex64", &[2])], "complex64"),
            (vec![m("a", "float32", &[usize::MAX, 4])], "overflows"),
            (vec![m("a", "float32", &[1000])], "more than the 100 bytes"),
        ];
        for (metas, want) in cases {
            let err = header_of(&metas, 100).unwrap_err().to_string();
            assert!(err.contains(want), "{metas:?}: {err}");
        }
    }

    /// A sender whose engine refused to join stops waiting at once, not after the
    /// connect timeout.
    #[test]
    fn a_rendezvous_its_caller_abandons_ends_at_once() {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rdv = CpuRendezvous::bind("127.0.0.1:0")
            .unwrap()
            .abandoned_by(flag.clone());
        let t = CpuCollectiveTimeouts {
            connect: Duration::from_secs(120),
            io: Duration::from_secs(120),
        };
        let start = std::time::Instant::now();
        let waiting = std::thread::spawn(move || rdv.accept(2, t));
        std::thread::sleep(Duration::from_millis(200));
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        let err = waiting
            .join()
            .unwrap()
            .err()
            .expect("abandoned")
            .to_string();
        assert!(err.contains("abandoned"), "{err}");
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn a_bucket_of_another_length_than_announced_is_refused() {
        let (mut root, mut other) = pair();
        let metas = vec![TensorMeta {
            name: "a".into(),
            dtype: "float32".into(),
            shape: vec![4],
        }];
        let rx = std::thread::spawn(move || receive(&mut other, &metas, usize::MAX));
        // 16 bytes announced; rank 0 sends 12.
        let mut data = vec![0u8; 12];
        let _ = root.broadcast_bytes_max(&mut data, 16);
        let err = rx.join().unwrap().unwrap_err().to_string();
        assert!(
            err.contains("sent 12 bytes") && err.contains("announced as 16"),
            "{err}"
        );
    }
}
