//! `starfish availability` without the rest of the `starfish` binary: the same arguments, the
//! same output. `cargo run --release -p availability --example availability -- --help`

use clap::Parser;

#[derive(Parser)]
#[command(name = "starfish availability")]
struct Command {
    #[command(flatten)]
    args: availability::cli::AvailabilityArgs,
}

fn main() -> anyhow::Result<()> {
    let command = Command::parse();
    availability::cli::run(&command.args, &mut std::io::stdout().lock())
}
