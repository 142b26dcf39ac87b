//! An event-driven simulation of element and HE failures and repairs, to check the closed forms
//! the way the paper checked Eq. 1 (with smpl).
//!
//! Each of the N elements and the HE alternates up and down with exponential up times (rate λ)
//! and down times (rate μ), independently — the paper's assumptions. The run starts from the
//! steady state, so it needs no warm-up. Time during which each availability predicate fails is
//! accumulated in equal batches of simulated time; the batch means give a 95 % confidence
//! interval. A run is a pure function of its configuration and seed.

use crate::model::{Component, Deployment};

/// Hours in an average year (365.25 days).
pub const HOURS_PER_YEAR: f64 = 365.25 * 24.0;

/// Batches for the batch-means confidence interval.
pub const BATCHES: usize = 20;

/// Student's t, 97.5 % quantile, BATCHES − 1 = 19 degrees of freedom.
const T_QUANTILE_975: f64 = 2.093;

/// Most events one run may take (about a minute of a release build).
pub const EVENTS_MAX: f64 = 2e9;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimulationError {
    #[error("{what} must be a positive finite number, got {value}")]
    NotPositive { what: &'static str, value: f64 },
    #[error(
        "the run would take about {events:.1e} events (at most {EVENTS_MAX:.0e}): simulate fewer \
         years or slower failure and repair rates"
    )]
    TooLong { events: f64 },
}

/// A component's failure rate λ and repair rate μ, per hour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    failure_per_hour: f64,
    repair_per_hour: f64,
}

impl Rates {
    pub fn new(failure_per_hour: f64, repair_per_hour: f64) -> Result<Self, SimulationError> {
        positive("the failure rate", failure_per_hour)?;
        positive("the repair rate", repair_per_hour)?;
        Ok(Rates { failure_per_hour, repair_per_hour })
    }

    /// The rates of `component` when a repair takes `mean_repair_hours` on average: μ = 1/MTTR,
    /// λ = ρ·μ.
    pub fn from_component(component: &Component, mean_repair_hours: f64) -> Result<Self, SimulationError> {
        positive("the mean time to repair", mean_repair_hours)?;
        let repair_per_hour = 1.0 / mean_repair_hours;
        let load = crate::decimal::to_f64(&component.load());
        Rates::new(load * repair_per_hour, repair_per_hour)
    }

    pub fn failure_per_hour(self) -> f64 {
        self.failure_per_hour
    }

    pub fn repair_per_hour(self) -> f64 {
        self.repair_per_hour
    }

    /// Steady-state probability of being down, λ/(λ+μ).
    pub fn down(self) -> f64 {
        self.failure_per_hour / (self.failure_per_hour + self.repair_per_hour)
    }

    /// Transitions per hour in steady state: 2λμ/(λ+μ).
    fn transitions_per_hour(self) -> f64 {
        2.0 * self.failure_per_hour * self.repair_per_hour / (self.failure_per_hour + self.repair_per_hour)
    }
}

fn positive(what: &'static str, value: f64) -> Result<(), SimulationError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(SimulationError::NotPositive { what, value })
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulationConfig {
    pub deployment: Deployment,
    pub element: Rates,
    pub he: Rates,
    pub years: f64,
    pub seed: u64,
}

/// Which elements are up (bit i: element i) and whether the HE is up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub elements_up: u64,
    pub he_up: bool,
}

/// The elements that hold the latest writes when the HE fails. The paper's Eq. 2 takes them
/// as a fixed set of Q elements; we take elements 0..Q.
fn quorum_mask(deployment: Deployment) -> u64 {
    mask(deployment.quorum())
}

fn mask(count: u32) -> u64 {
    if count >= 64 {
        u64::MAX
    } else {
        (1u64 << count) - 1
    }
}

/// Eq. 1's event: at least Q elements are up.
pub fn write_quorum_available(deployment: Deployment, state: State) -> bool {
    state.elements_up.count_ones() >= deployment.quorum()
}

/// Eq. 2's event: the HE and any element are up, or the HE is down and one of the Q elements
/// holding the latest writes is up.
pub fn read_only_available(deployment: Deployment, state: State) -> bool {
    if state.he_up {
        state.elements_up != 0
    } else {
        state.elements_up & quorum_mask(deployment) != 0
    }
}

/// The paper's loss condition: the HE and the Q elements holding the latest writes all down
/// (it loses data only where Q ≤ ⌊N/2⌋).
pub fn loss_exposed(deployment: Deployment, state: State) -> bool {
    !state.he_up && state.elements_up & quorum_mask(deployment) == 0
}

/// A simulated unavailability with its 95 % confidence interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Estimate {
    /// Share of simulated time the predicate failed.
    pub unavailability: f64,
    /// Half the width of the 95 % batch-means confidence interval.
    pub half_width_95: f64,
    /// Times the predicate went from holding to failing.
    pub outages: u64,
}

impl Estimate {
    pub fn interval_95(&self) -> (f64, f64) {
        ((self.unavailability - self.half_width_95).max(0.0), self.unavailability + self.half_width_95)
    }

    pub fn contains(&self, unavailability: f64) -> bool {
        let (low, high) = self.interval_95();
        low <= unavailability && unavailability <= high
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimulationReport {
    pub config: SimulationConfig,
    pub write_quorum: Estimate,
    pub read_only: Estimate,
    pub loss_exposure: Estimate,
    pub element_failures: u64,
    pub he_failures: u64,
    pub events: u64,
}

/// SplitMix64 (Steele, Lea, Flood 2014): small, fast, and the same sequence on every platform
/// and every version of this crate, so a seed replays exactly.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1): 53 random bits, centred in their interval so that 0 never occurs.
    fn open_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn exponential(&mut self, rate: f64) -> f64 {
        -self.open_unit().ln() / rate
    }

    fn bernoulli(&mut self, probability: f64) -> bool {
        self.open_unit() < probability
    }
}

/// Downtime of one predicate, per batch.
struct Tally {
    down_hours: [f64; BATCHES],
    outages: u64,
}

impl Tally {
    fn new() -> Self {
        Tally { down_hours: [0.0; BATCHES], outages: 0 }
    }

    fn estimate(&self, batch_hours: f64) -> Estimate {
        let batches = BATCHES as f64;
        let means = self.down_hours.map(|hours| hours / batch_hours);
        let mean = means.iter().sum::<f64>() / batches;
        let variance = means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (batches - 1.0);
        Estimate {
            unavailability: mean,
            half_width_95: T_QUANTILE_975 * (variance / batches).sqrt(),
            outages: self.outages,
        }
    }
}

/// The expected number of events of a run, to refuse runs that would not end.
pub fn expected_events(config: &SimulationConfig) -> f64 {
    let hours = config.years * HOURS_PER_YEAR;
    let elements = f64::from(config.deployment.elements());
    hours * (elements * config.element.transitions_per_hour() + config.he.transitions_per_hour())
}

pub fn simulate(config: &SimulationConfig) -> Result<SimulationReport, SimulationError> {
    positive("the simulated time in years", config.years)?;
    let events = expected_events(config);
    if events.is_nan() || events > EVENTS_MAX {
        return Err(SimulationError::TooLong { events });
    }
    let deployment = config.deployment;
    let n = usize::try_from(deployment.elements()).expect("N ≤ ELEMENTS_MAX");
    let mut rng = SplitMix64(config.seed);

    // Component i < n is element i; component n is the HE.
    let rates: Vec<Rates> = (0..=n).map(|i| if i < n { config.element } else { config.he }).collect();
    let mut up: Vec<bool> = rates.iter().map(|r| !rng.bernoulli(r.down())).collect();
    let mut next_hours: Vec<f64> = rates
        .iter()
        .zip(&up)
        .map(|(r, &is_up)| rng.exponential(if is_up { r.failure_per_hour } else { r.repair_per_hour }))
        .collect();
    let state_of = |up: &[bool]| State {
        elements_up: up[..n].iter().enumerate().fold(0u64, |m, (i, &u)| m | (u64::from(u) << i)),
        he_up: up[n],
    };
    let predicates = |state: State| {
        [
            write_quorum_available(deployment, state),
            read_only_available(deployment, state),
            !loss_exposed(deployment, state),
        ]
    };

    let total_hours = config.years * HOURS_PER_YEAR;
    let batch_hours = total_hours / BATCHES as f64;
    let mut tallies = [Tally::new(), Tally::new(), Tally::new()];
    let mut holding = predicates(state_of(&up));
    let mut now = 0.0_f64;
    let mut batch = 0usize;
    let (mut element_failures, mut he_failures, mut event_count) = (0u64, 0u64, 0u64);

    loop {
        let (component, &at) =
            next_hours.iter().enumerate().min_by(|a, b| a.1.total_cmp(b.1)).expect("at least one element and the HE");
        let until = at.min(total_hours);
        // Account [now, until) to the predicates' current values, batch by batch.
        while now < until {
            let batch_end = if batch + 1 == BATCHES { total_hours } else { (batch + 1) as f64 * batch_hours };
            let step_end = until.min(batch_end);
            for (tally, &ok) in tallies.iter_mut().zip(&holding) {
                if !ok {
                    tally.down_hours[batch] += step_end - now;
                }
            }
            now = step_end;
            if now >= batch_end && batch + 1 < BATCHES {
                batch += 1;
            }
        }
        if at >= total_hours {
            break;
        }
        event_count += 1;
        up[component] = !up[component];
        let rate = rates[component];
        if !up[component] {
            if component < n {
                element_failures += 1;
            } else {
                he_failures += 1;
            }
        }
        next_hours[component] =
            at + rng.exponential(if up[component] { rate.failure_per_hour } else { rate.repair_per_hour });
        let state = state_of(&up);
        let now_holding = predicates(state);
        for ((tally, &was), &is) in tallies.iter_mut().zip(&holding).zip(&now_holding) {
            if was && !is {
                tally.outages += 1;
            }
        }
        holding = now_holding;
    }
    let [write_quorum, read_only, loss_exposure] = tallies.map(|t| t.estimate(batch_hours));
    Ok(SimulationReport {
        config: *config,
        write_quorum,
        read_only,
        loss_exposure,
        element_failures,
        he_failures,
        events: event_count,
    })
}

#[cfg(test)]
mod tests {
    use num_rational::BigRational;
    use num_traits::Zero;

    use super::*;
    use crate::decimal::to_f64;
    use crate::model::{loss_exposure, read_only_unavailability, write_quorum_unavailability};

    fn ratio(numerator: i64, denominator: i64) -> BigRational {
        BigRational::new(numerator.into(), denominator.into())
    }

    fn load(numerator: i64, denominator: i64) -> Component {
        Component::from_load(&ratio(numerator, denominator)).expect("valid load")
    }

    /// Integrates each predicate over the exact steady-state distribution of all 2^(N+1)
    /// states — independent components, so a state's probability is a product — and returns
    /// the probability that it fails.
    fn failing_probability(
        deployment: Deployment,
        element: &Component,
        he: &Component,
        predicate: fn(Deployment, State) -> bool,
    ) -> BigRational {
        let n = deployment.elements();
        let mut total = BigRational::zero();
        for elements_up in 0..(1u64 << n) {
            for he_up in [false, true] {
                let state = State { elements_up, he_up };
                if predicate(deployment, state) {
                    continue;
                }
                let ups = i32::try_from(elements_up.count_ones()).expect("small");
                let downs = i32::try_from(n).expect("small") - ups;
                let mut probability = element.up().pow(ups) * element.down().pow(downs);
                probability *= if he_up { he.up() } else { he.down().clone() };
                total += probability;
            }
        }
        total
    }

    #[test]
    fn predicates_are_the_equations_definitions() {
        let components = [load(1, 9), load(1, 1), load(3, 7)];
        let hes = [load(1, 10), load(1, 2), load(5, 1)];
        for n in 1..=6 {
            for q in 1..=n {
                let deployment = Deployment::new(n, q).expect("valid");
                for element in &components {
                    for he in &hes {
                        let write = failing_probability(deployment, element, he, write_quorum_available);
                        assert_eq!(&write, write_quorum_unavailability(deployment, element).exact());
                        let read = failing_probability(deployment, element, he, read_only_available);
                        assert_eq!(&read, read_only_unavailability(deployment, element, he).exact());
                        let exposed = failing_probability(deployment, element, he, |d, s| !loss_exposed(d, s));
                        let expected = loss_exposure(deployment, element, he);
                        if let Some(expected) = expected {
                            assert_eq!(exposed, expected);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn predicates_by_hand() {
        let d = Deployment::new(3, 2).expect("valid");
        // (elements up, HE up, write quorum, read-only, loss exposed)
        #[track_caller]
        fn check(d: Deployment, elements_up: u64, he_up: bool, expected: (bool, bool, bool)) {
            let s = State { elements_up, he_up };
            assert_eq!((write_quorum_available(d, s), read_only_available(d, s), loss_exposed(d, s)), expected);
        }
        check(d, 0b111, true, (true, true, false));
        check(d, 0b011, false, (true, true, false));
        check(d, 0b100, true, (false, true, false));
        // HE down: only elements 0 and 1 hold the latest writes.
        check(d, 0b100, false, (false, false, true));
        check(d, 0b110, false, (true, true, false));
        check(d, 0b000, true, (false, false, false));
        check(d, 0b000, false, (false, false, true));
    }

    #[test]
    fn deterministic_for_a_seed() {
        let config = SimulationConfig {
            deployment: Deployment::new(3, 2).expect("valid"),
            element: Rates::new(1.0 / 216.0, 1.0 / 24.0).expect("valid"),
            he: Rates::new(1.0 / 216.0, 1.0 / 24.0).expect("valid"),
            years: 20.0,
            seed: 7,
        };
        let a = simulate(&config).expect("valid");
        let b = simulate(&config).expect("valid");
        assert_eq!(a, b);
        let c = simulate(&SimulationConfig { seed: 8, ..config }).expect("valid");
        assert_ne!(a.write_quorum, c.write_quorum);
    }

    /// Simulation against the closed forms where the simulation can resolve them: loads from
    /// 0.1 to 1, so outages number in the thousands.
    #[test]
    fn agrees_with_closed_forms() {
        // (N, Q, element ρ, HE ρ, years, seed)
        #[track_caller]
        fn check(n: u32, q: u32, rho: (i64, i64), rho_he: (i64, i64), years: f64, seed: u64) {
            let deployment = Deployment::new(n, q).expect("valid");
            let element = load(rho.0, rho.1);
            let he = load(rho_he.0, rho_he.1);
            let mttr_hours = 24.0;
            let config = SimulationConfig {
                deployment,
                element: Rates::from_component(&element, mttr_hours).expect("valid"),
                he: Rates::from_component(&he, mttr_hours).expect("valid"),
                years,
                seed,
            };
            let report = simulate(&config).expect("valid");
            let closed = [
                (
                    "write quorum",
                    report.write_quorum,
                    to_f64(write_quorum_unavailability(deployment, &element).exact()),
                ),
                ("read-only", report.read_only, to_f64(read_only_unavailability(deployment, &element, &he).exact())),
                (
                    "exposure",
                    report.loss_exposure,
                    to_f64(&(he.down() * element.down().pow(i32::try_from(q).expect("small")))),
                ),
            ];
            for (what, estimate, expected) in closed {
                assert!(estimate.outages > 300, "{what}: too few outages to judge: {estimate:?}");
                // Four half-widths of a 95 % interval: a seed that fails this is a bug, not luck.
                let tolerance = 4.0 * estimate.half_width_95;
                assert!(
                    (estimate.unavailability - expected).abs() <= tolerance,
                    "N={n} Q={q} {what}: simulated {estimate:?}, closed form {expected}"
                );
                // And the interval is tight enough to mean something.
                assert!(estimate.half_width_95 < 0.15 * expected, "{what}: {estimate:?} vs {expected}");
            }
        }
        check(1, 1, (1, 9), (1, 9), 1000.0, 1);
        check(3, 2, (1, 9), (1, 9), 3000.0, 2);
        check(3, 1, (1, 3), (1, 3), 1000.0, 3);
        check(3, 3, (1, 9), (1, 1), 1000.0, 4);
        check(5, 2, (1, 2), (1, 5), 500.0, 5);
        check(2, 1, (1, 1), (1, 1), 300.0, 6);
    }

    #[test]
    fn resolves_differences_between_configurations() {
        // The simulation tells N = 3, Q = 2 from N = 3, Q = 1 apart (U = 0.028 vs 0.001 at ρ = 1/9).
        let rates = Rates::from_component(&load(1, 9), 24.0).expect("valid");
        let run = |q| {
            simulate(&SimulationConfig {
                deployment: Deployment::new(3, q).expect("valid"),
                element: rates,
                he: rates,
                years: 200.0,
                seed: 11,
            })
            .expect("valid")
        };
        let (q1, q2) = (run(1), run(2));
        assert!(q1.write_quorum.interval_95().1 < q2.write_quorum.interval_95().0);
    }

    #[test]
    fn rates() {
        let component = Component::from_availability(&ratio(99, 100)).expect("valid");
        let rates = Rates::from_component(&component, 24.0).expect("valid");
        assert!((rates.repair_per_hour() - 1.0 / 24.0).abs() < 1e-15);
        assert!((rates.failure_per_hour() - 1.0 / (24.0 * 99.0)).abs() < 1e-15);
        assert!((rates.down() - 0.01).abs() < 1e-15);
        assert!(Rates::new(0.0, 1.0).is_err());
        assert!(Rates::new(1.0, f64::NAN).is_err());
        assert!(Rates::from_component(&component, -1.0).is_err());
    }

    #[test]
    fn refuses_endless_and_empty_runs() {
        let config = SimulationConfig {
            deployment: Deployment::new(3, 2).expect("valid"),
            element: Rates::new(1.0, 1.0).expect("valid"),
            he: Rates::new(1.0, 1.0).expect("valid"),
            years: 1e9,
            seed: 1,
        };
        assert!(matches!(simulate(&config), Err(SimulationError::TooLong { .. })));
        assert!(matches!(
            simulate(&SimulationConfig { years: 0.0, ..config }),
            Err(SimulationError::NotPositive { .. })
        ));
        assert!(matches!(
            simulate(&SimulationConfig { years: f64::NAN, ..config }),
            Err(SimulationError::NotPositive { .. })
        ));
    }
}
