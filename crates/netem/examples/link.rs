//! `starfish link` without the rest of the binary, for measuring the link emulation before the
//! subcommand is mounted: `cargo run --release -p netem --example link -- --measure --netns …`.

use clap::Parser;

#[derive(Parser)]
#[command(name = "link")]
struct Cli {
    #[command(flatten)]
    link: netem::cli::LinkArgs,
}

fn main() -> anyhow::Result<()> {
    netem::cli::run(&Cli::parse().link)
}
