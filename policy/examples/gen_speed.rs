//! Quick generation timing: `cargo run --release -p tutor-policy --example gen_speed`.
use std::time::Instant;
use tutor_policy::{GenParams, ModelConfig, Policy};

fn main() {
    let threads: i32 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if threads > 0 {
        tch::set_num_threads(threads);
    }
    let policy = Policy::new(ModelConfig::tiny(1024), tch::Device::Cpu, 0);
    for ctx in [200usize, 1500] {
        let prompt: Vec<u32> = (0..ctx).map(|i| (i % 1000) as u32 + 3).collect();
        let params = GenParams {
            temperature: 1.0,
            max_new_tokens: 64,
            seed: 1,
            stop_token_ids: vec![],
        };
        let t = Instant::now();
        let g = policy.generate(&[prompt], &[params]);
        let dt = t.elapsed().as_secs_f64();
        println!(
            "ctx {ctx}: {} tokens in {dt:.3}s = {:.1} ms/token (threads {})",
            g[0].tokens.len(),
            dt * 1000.0 / g[0].tokens.len() as f64,
            tch::get_num_threads()
        );
    }
}
