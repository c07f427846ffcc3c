//! Loading a checkpoint costs the model's memory, not the checkpoint's size on top: the
//! files are memory-mapped and copied into the model one tensor at a time. (Reading every
//! shard whole and holding all its tensors, as before, needed about three times the
//! model's size in anonymous memory at the peak.)

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::Device;
use tutor_policy::{ModelConfig, Policy};

/// Anonymous resident memory of this process, in bytes (`RssAnon` of /proc/self/status).
/// File pages of the mapped checkpoint are not in it: they are page cache.
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .expect("RssAnon in /proc/self/status");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb * 1024
}

#[test]
fn loading_a_checkpoint_needs_about_the_models_memory_once() {
    let mut c = ModelConfig::tiny(8192);
    c.hidden_size = 1024;
    c.intermediate_size = 2816;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 8;
    c.num_key_value_heads = 8;
    c.head_dim = 128;
    let dir = tempfile::tempdir().unwrap();
    {
        let p = Policy::new(c, Device::Cpu, 0);
        p.save_dir(dir.path()).unwrap();
    }
    let bytes = std::fs::metadata(dir.path().join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        bytes > 100 << 20,
        "the checkpoint is too small to measure: {bytes}"
    );
    // Give the freed memory of the saved model back, so that the load's allocations show.
    // SAFETY: plain glibc call, no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
    let base = rss_anon();
    let peak = Arc::new(AtomicU64::new(base));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                peak.fetch_max(rss_anon(), Ordering::SeqCst);
                std::thread::sleep(Duration::from_micros(500));
            }
        })
    };
    let loaded = Policy::load_dir(dir.path(), Device::Cpu).unwrap();
    peak.fetch_max(rss_anon(), Ordering::SeqCst);
    stop.store(true, Ordering::SeqCst);
    sampler.join().unwrap();
    let grew = peak.load(Ordering::SeqCst).saturating_sub(base);
    println!(
        "checkpoint {} MB; anonymous memory grew by {} MB at the peak of the load",
        bytes >> 20,
        grew >> 20
    );
    assert!(
        (grew as f64) < 1.6 * bytes as f64,
        "loading a {} MB checkpoint took {} MB of anonymous memory at its peak",
        bytes >> 20,
        grew >> 20
    );
    // The measurement sees the model itself (else the bound above says nothing).
    assert!(
        (grew as f64) > 0.7 * bytes as f64,
        "grew by only {grew} bytes"
    );
    drop(loaded);
}
