//! Learner: owns the optimizer and the student's training weights; trains on token-level
//! batches from the coordinator and publishes each new policy version as safetensors.

pub mod checkpoint;
pub mod config;
pub mod group;
pub mod loss;
pub mod optim;
pub mod packing;
pub mod plan;
pub mod schedule;
pub mod service;
pub mod trainer;
pub mod weights;

pub use config::{CollectiveChoice, LearnerConfig};
pub use service::{serve, LearnerHandle, LearnerStats, ServeOptions};
pub use trainer::{NonFinite, StepError, StepReport, Trainer};
pub use tutor_collective::{Collective, CollectiveError, CpuCollective};
pub use weights::WeightsStore;
