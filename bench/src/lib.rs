//! Benchmarks of Tutor's services, run over loopback against real servers started in
//! process. `ingest`: how many turns per second the coordinator stores durably.

pub mod ingest;
