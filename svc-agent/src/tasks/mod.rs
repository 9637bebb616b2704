//! The agent's side effects, each a task of its own.

pub mod health;
pub mod stale;
pub mod sweep;
