//! Decides at build time whether the namespace tests can run here, so that they show up as
//! `ignored, <reason>` instead of passing vacuously: libtest has no run-time skip. The tests
//! check the same conditions again at run time and fail loudly if the build was made elsewhere.

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(netem_no_netns)");
    println!("cargo::rerun-if-changed=build.rs");
    let mut missing = Vec::new();
    if !is_root() {
        missing.push("root");
    }
    if find_in_path("ip").is_none() {
        missing.push("`ip` (Debian package iproute2)");
        // Run again once iproute2 is installed.
        for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
            println!("cargo::rerun-if-changed={dir}");
        }
    }
    if !Path::new("/dev/net/tun").exists() {
        missing.push("/dev/net/tun");
    }
    if !missing.is_empty() {
        println!("cargo::rustc-cfg=netem_no_netns");
        println!("cargo::warning=netem's namespace tests will be ignored: missing {}", missing.join(", "));
    }
}

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))
        .and_then(|uids| uids.split_whitespace().nth(1))
        .is_some_and(|euid| euid == "0")
}

fn find_in_path(program: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(std::path::PathBuf::from))
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}
