//! fio's nbd engine as the benchmark client: one job description, its command line, and the
//! figures read out of `--output-format=json`.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::process::run_bounded;

#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    /// fio's `rw`: randwrite, randread, write, read.
    pub rw: &'static str,
    pub block_bytes: u64,
    /// Parallel jobs (connections), each with iodepth 1: the paper's threads.
    pub jobs: u32,
    /// The range of the volume the I/O falls in, from offset 0.
    pub range_bytes: u64,
    /// I/Os per job; `None`: run for `runtime_s` (time based).
    pub ios_per_job: Option<u64>,
    /// Upper bound (count-based jobs) or length (time-based jobs) of the measurement.
    pub runtime_s: u64,
    pub ramp_s: u64,
    pub iodepth: u32,
}

impl Job {
    pub fn args(&self, uri: &str) -> Vec<String> {
        let mut args = vec![
            "--name=starfish-bench".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri={uri}"),
            format!("--rw={}", self.rw),
            format!("--bs={}", self.block_bytes),
            format!("--iodepth={}", self.iodepth),
            format!("--numjobs={}", self.jobs),
            format!("--size={}", self.range_bytes),
            format!("--runtime={}", self.runtime_s),
            "--group_reporting".to_string(),
            "--randrepeat=0".to_string(),
            "--output-format=json".to_string(),
        ];
        match self.ios_per_job {
            Some(n) => args.push(format!("--number_ios={n}")),
            None => args.push("--time_based".to_string()),
        }
        if self.ramp_s > 0 {
            args.push(format!("--ramp_time={}", self.ramp_s));
        }
        args
    }

    fn is_write(&self) -> bool {
        self.rw.contains("write")
    }
}

/// What one fio run measured, for the direction the job does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Figures {
    /// Mean completion-to-submission latency (fio's `lat`), milliseconds.
    pub latency_ms: f64,
    /// Megabytes (10⁶ bytes) per second over all jobs.
    pub throughput_mb_s: f64,
    pub ios: u64,
}

pub fn run(uri: &str, job: &Job, scratch: &Path) -> Result<Figures> {
    run_as(uri, job, scratch, None)
}

/// With `home`: fio runs as an unprivileged user (a user namespace) with that `HOME`, where
/// libnbd finds its TLS certificates (`.pki/libnbd`; it refuses paths in the URI of fio).
pub fn run_as(uri: &str, job: &Job, scratch: &Path, home: Option<&Path>) -> Result<Figures> {
    let mut cmd = match home {
        Some(home) => {
            let mut cmd = Command::new("unshare");
            cmd.arg("--user").arg("fio").env("HOME", home);
            cmd
        }
        None => Command::new("fio"),
    };
    cmd.args(job.args(uri));
    let bound = Duration::from_secs(job.runtime_s + job.ramp_s + 60);
    let out = run_bounded(&format!("fio {} on {uri}", job.rw), &mut cmd, bound, scratch)?;
    parse(&out.stdout, job.is_write()).with_context(|| format!("reading fio's output (stderr: {})", out.stderr.trim()))
}

/// Reads the first (group-reported) job of fio's JSON output; fio may print notes before it.
pub fn parse(stdout: &str, write: bool) -> Result<Figures> {
    let start = stdout.find('{').context("fio printed no JSON")?;
    let doc: Value = serde_json::from_str(&stdout[start..]).context("fio printed bad JSON")?;
    let job = &doc["jobs"][0];
    if job.is_null() {
        bail!("fio's JSON has no job");
    }
    if job["error"].as_i64().unwrap_or(0) != 0 {
        bail!("fio reported error {}", job["error"]);
    }
    let side = &job[if write { "write" } else { "read" }];
    let ios = side["total_ios"].as_u64().context("fio's JSON lacks total_ios")?;
    if ios == 0 {
        bail!("fio completed no I/O");
    }
    let latency_ns = side["lat_ns"]["mean"].as_f64().context("fio's JSON lacks lat_ns.mean")?;
    let bandwidth = side["bw_bytes"].as_f64().context("fio's JSON lacks bw_bytes")?;
    Ok(Figures { latency_ms: latency_ns / 1e6, throughput_mb_s: bandwidth / 1e6, ios })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"note: both iodepth >= 1 and synchronous I/O engine are selected
{
  "fio version" : "fio-3.33",
  "jobs" : [
    {
      "jobname" : "starfish-bench",
      "error" : 0,
      "read" : { "total_ios" : 0, "bw_bytes" : 0, "lat_ns" : { "min" : 0, "max" : 0, "mean" : 0.0 } },
      "write" : { "total_ios" : 1200, "bw_bytes" : 3276800, "iops" : 400.0,
                  "lat_ns" : { "min" : 1000000, "max" : 9000000, "mean" : 2500000.5 } }
    }
  ]
}"#;

    #[test]
    fn parses_the_direction_of_the_job() {
        let figures = parse(SAMPLE, true).expect("sample parses");
        assert_eq!(figures.ios, 1200);
        assert!((figures.latency_ms - 2.5000005).abs() < 1e-9);
        assert!((figures.throughput_mb_s - 3.2768).abs() < 1e-9);
        // The read side did nothing: an error, not a zero latency.
        assert!(parse(SAMPLE, false).is_err());
        assert!(parse("fio: engine nbd not loadable", true).is_err());
        assert!(parse(r#"{"jobs":[{"error":5,"write":{}}]}"#, true).is_err());
    }

    #[test]
    fn count_or_time_based() {
        let mut job = Job {
            rw: "randwrite",
            block_bytes: 8192,
            jobs: 1,
            range_bytes: 1 << 30,
            ios_per_job: None,
            runtime_s: 5,
            ramp_s: 1,
            iodepth: 1,
        };
        let args = job.args("nbd://127.0.0.1:1/vol0");
        assert!(args.contains(&"--time_based".to_string()));
        assert!(args.contains(&"--bs=8192".to_string()));
        assert!(args.contains(&"--ramp_time=1".to_string()));
        job.ios_per_job = Some(100);
        job.ramp_s = 0;
        let args = job.args("nbd://127.0.0.1:1/vol0");
        assert!(args.contains(&"--number_ios=100".to_string()));
        assert!(!args.iter().any(|a| a == "--time_based" || a.starts_with("--ramp_time")));
    }
}
