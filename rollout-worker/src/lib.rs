//! Rollout worker: runs episodes (sandbox, student, teacher, grading) for leases from the
//! coordinator and streams every turn back; also the task formats and the toy tasks.

pub mod action;
pub mod context;
pub mod episode;
pub mod eval;
pub mod grade;
pub mod harness;
pub mod mixing;
pub mod observation;
pub mod sandbox;
pub mod sink;
pub mod student;
pub mod student_engine;
pub mod tasks;
pub mod teacher;
pub mod tools;
pub mod toy;
pub mod weights;
pub mod worker;
