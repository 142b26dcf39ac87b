//! The StarFish paper's availability and reliability analysis (its section 4), as a tool to size
//! a deployment: the closed forms (Eq. 1, write quorum; Eq. 2, read-only consistency) in exact
//! arithmetic, the paper's Tables 1 and 2, the smallest N and Q for a target, an event-driven
//! simulation of failures and repairs that checks the closed forms, and the paper's Figures 3
//! and 4 as PNGs. `cli` is the `starfish availability` subcommand.
//!
//! The model is pure (no I/O, randomness seeded by the caller); only `plot` writes a file and
//! `cli` writes to the writer it is given.

pub mod cli;
pub mod decimal;
pub mod model;
pub mod plot;
pub mod recommend;
pub mod simulate;
pub mod table;

pub use decimal::Decimal;
pub use model::{
    loss_exposure, paper_loss_bound, read_only_unavailability, unavailability, write_quorum_unavailability, Component,
    Consistency, Deployment, ModelError, Reading, Unavailability, ELEMENTS_MAX,
};
