//! The closed forms of the paper's section 4, in exact rational arithmetic.
//!
//! Elements and the HE fail and recover independently, each an alternating up/down process
//! with exponential times (failure rate λ, recovery rate μ, load ρ = λ/μ). In steady state a
//! component is down with probability p = ρ/(1+ρ), and elements are independent, so the number
//! of elements down is binomial — the form of the paper's Eq. 1.
//!
//! Everything here computes the *unavailability* directly, as a sum of the failing states,
//! never as 1 − availability: at 12 nines the difference is the whole answer.

use num_bigint::BigInt;
use num_rational::BigRational;
use num_traits::{One, Signed, Zero};

use crate::decimal::{is_open_unit, pow10, to_f64};

/// Most elements a deployment may have here (the paper considers up to 7).
pub const ELEMENTS_MAX: u32 = 64;

/// Minutes in an average year (365.25 days), for downtime figures.
pub const MINUTES_PER_YEAR: f64 = 365.25 * 24.0 * 60.0;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("a deployment needs at least one element (N ≥ 1)")]
    NoElements,
    #[error("at most {max} elements are supported, got N = {elements}")]
    TooManyElements { elements: u32, max: u32 },
    #[error("the write quorum must satisfy 1 ≤ Q ≤ N = {elements}, got Q = {quorum}")]
    QuorumOutOfRange { quorum: u32, elements: u32 },
    #[error("an availability must lie strictly between 0 and 1 (0 % and 100 %), got {value}")]
    AvailabilityOutOfRange { value: f64 },
    #[error("{what} must be greater than 0, got {value}")]
    NotPositive { what: &'static str, value: f64 },
}

/// How the write path behaves when fewer than Q elements are up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// The volume is available while at least Q elements are up (the paper's Eq. 1). The HE is
    /// assumed always replaceable by a backup HE (the paper's section 4).
    WriteQuorum,
    /// Read-only consistency (the paper's section 4.2, Eq. 2): the volume stays readable while
    /// the HE and any element are up, or, with the HE down, while one of the Q elements that
    /// hold the latest writes is up.
    ReadOnly,
}

impl Consistency {
    pub fn name(self) -> &'static str {
        match self {
            Consistency::WriteQuorum => "write-quorum",
            Consistency::ReadOnly => "read-only",
        }
    }

    pub fn equation(self) -> &'static str {
        match self {
            Consistency::WriteQuorum => "Eq. 1",
            Consistency::ReadOnly => "Eq. 2",
        }
    }
}

/// N elements with write quorum Q, 1 ≤ Q ≤ N ≤ [`ELEMENTS_MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deployment {
    elements: u32,
    quorum: u32,
}

impl Deployment {
    pub fn new(elements: u32, quorum: u32) -> Result<Self, ModelError> {
        if elements == 0 {
            return Err(ModelError::NoElements);
        }
        if elements > ELEMENTS_MAX {
            return Err(ModelError::TooManyElements { elements, max: ELEMENTS_MAX });
        }
        if quorum == 0 || quorum > elements {
            return Err(ModelError::QuorumOutOfRange { quorum, elements });
        }
        Ok(Deployment { elements, quorum })
    }

    pub fn elements(self) -> u32 {
        self.elements
    }

    pub fn quorum(self) -> u32 {
        self.quorum
    }

    /// Q ≤ ⌊N/2⌋: two write quorums need not share an element, so losing the HE and the Q
    /// elements that hold the latest writes loses those writes (the paper's section 4.2). With
    /// Q > ⌊N/2⌋ any Q surviving elements include an up-to-date one.
    pub fn can_lose_data(self) -> bool {
        self.quorum <= self.elements / 2
    }
}

/// How an availability figure is turned into a component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    /// The component is up with exactly this probability.
    Exact,
    /// The paper's reading for its tables: availability A names the load ρ = 1 − A ("typical
    /// values of ρ range from 0.1 to 0.001, which correspond to hardware availability of 90 %
    /// to 99.9 %"), so "99 %" is ρ = 0.01, an availability of 1/1.01 = 99.0099 %.
    PaperLoad,
}

/// An element or the HE, by its steady-state probability of being down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    down: BigRational,
}

impl Component {
    /// Up with probability `availability`, 0 < A < 1.
    pub fn from_availability(availability: &BigRational) -> Result<Self, ModelError> {
        if !is_open_unit(availability) {
            return Err(ModelError::AvailabilityOutOfRange { value: to_f64(availability) });
        }
        Ok(Component { down: BigRational::one() - availability })
    }

    /// An availability figure read as `reading` says.
    pub fn from_availability_read(availability: &BigRational, reading: Reading) -> Result<Self, ModelError> {
        match reading {
            Reading::Exact => Component::from_availability(availability),
            Reading::PaperLoad => {
                if !is_open_unit(availability) {
                    return Err(ModelError::AvailabilityOutOfRange { value: to_f64(availability) });
                }
                Component::from_load(&(BigRational::one() - availability))
            }
        }
    }

    /// Load ρ = λ/μ > 0; down with probability ρ/(1+ρ).
    pub fn from_load(load: &BigRational) -> Result<Self, ModelError> {
        if !load.is_positive() {
            return Err(ModelError::NotPositive { what: "the load ρ", value: to_f64(load) });
        }
        Ok(Component { down: load / (BigRational::one() + load) })
    }

    /// Failure rate λ and recovery rate μ, both > 0 and in the same unit; down with
    /// probability λ/(λ+μ).
    pub fn from_rates(failure_rate: &BigRational, repair_rate: &BigRational) -> Result<Self, ModelError> {
        if !failure_rate.is_positive() {
            return Err(ModelError::NotPositive { what: "the failure rate", value: to_f64(failure_rate) });
        }
        if !repair_rate.is_positive() {
            return Err(ModelError::NotPositive { what: "the repair rate", value: to_f64(repair_rate) });
        }
        Ok(Component { down: failure_rate / (failure_rate + repair_rate) })
    }

    /// Steady-state probability of being down, p.
    pub fn down(&self) -> &BigRational {
        &self.down
    }

    /// Steady-state probability of being up, 1 − p.
    pub fn up(&self) -> BigRational {
        BigRational::one() - &self.down
    }

    /// ρ = p/(1 − p) = λ/μ.
    pub fn load(&self) -> BigRational {
        &self.down / self.up()
    }
}

/// A probability of being unavailable, held exactly, with the ways operators read it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Unavailability(BigRational);

impl Unavailability {
    /// Wraps a probability in [0, 1].
    pub fn new(probability: BigRational) -> Self {
        assert!(!probability.is_negative() && probability <= BigRational::one(), "a probability");
        Unavailability(probability)
    }

    pub fn exact(&self) -> &BigRational {
        &self.0
    }

    pub fn availability(&self) -> BigRational {
        BigRational::one() - &self.0
    }

    pub fn to_f64(&self) -> f64 {
        to_f64(&self.0)
    }

    /// The nearest `f64` to the availability (1.0 once it is within 2⁻⁵³ of 1; read
    /// [`Unavailability::to_f64`] there).
    pub fn availability_f64(&self) -> f64 {
        to_f64(&self.availability())
    }

    /// Does the availability have at least `nines` nines, i.e. is U ≤ 10^−nines?
    pub fn meets(&self, nines: u32) -> bool {
        self.0 <= pow10(-i64::from(nines))
    }

    /// The count of nines: the largest k with U ≤ 10^−k (99.95 % has 3, 99.9 % has 3).
    /// `u32::MAX` for an unavailability of 0.
    pub fn nines(&self) -> u32 {
        if self.0.is_zero() {
            return u32::MAX;
        }
        let ten = BigRational::from_integer(BigInt::from(10u32));
        let mut nines = 0;
        let mut scaled = self.0.clone();
        // U·10^(k+1) ≤ 1 ⇔ U ≤ 10^−(k+1)
        loop {
            scaled *= &ten;
            if scaled > BigRational::one() {
                return nines;
            }
            nines += 1;
        }
    }

    /// −log₁₀ U: 5.7 for U = 2·10⁻⁶. Infinite for U = 0.
    pub fn nines_fractional(&self) -> f64 {
        let nines = self.nines();
        if nines == u32::MAX {
            return f64::INFINITY;
        }
        // Scale into (0.1, 1] first so that tiny values keep their precision in an f64.
        let scaled = &self.0 * pow10(i64::from(nines));
        f64::from(nines) - to_f64(&scaled).log10()
    }

    /// Expected downtime, in minutes per year.
    pub fn downtime_minutes_per_year(&self) -> f64 {
        self.to_f64() * MINUTES_PER_YEAR
    }
}

fn binomial(n: u32, k: u32) -> BigInt {
    assert!(k <= n);
    let mut value = BigInt::one();
    for i in 0..k {
        value = value * BigInt::from(n - i) / BigInt::from(i + 1);
    }
    value
}

/// Eq. 1's complement: the probability that fewer than Q elements are up,
/// Σ_{i=N−Q+1..N} C(N,i) pⁱ (1−p)^(N−i), with i the number of elements down.
pub fn write_quorum_unavailability(deployment: Deployment, element: &Component) -> Unavailability {
    let n = deployment.elements();
    let down = element.down();
    let up = element.up();
    let mut sum = BigRational::zero();
    for i in (n - deployment.quorum() + 1)..=n {
        let term = down.pow(exponent(i)) * up.pow(exponent(n - i));
        sum += BigRational::from_integer(binomial(n, i)) * term;
    }
    Unavailability::new(sum)
}

/// Eq. 2's complement. Eq. 2 is (1−x)·(1 − p^N) + x·(1 − p^Q) with x the HE's probability of
/// being down: readable if the HE and any element are up, or, the HE down, if any of the Q
/// elements holding the latest writes is up. Its complement is (1−x)·p^N + x·p^Q.
pub fn read_only_unavailability(deployment: Deployment, element: &Component, he: &Component) -> Unavailability {
    let p = element.down();
    let all_down = p.pow(exponent(deployment.elements()));
    let quorum_down = p.pow(exponent(deployment.quorum()));
    Unavailability::new(he.up() * all_down + he.down() * quorum_down)
}

pub fn unavailability(
    deployment: Deployment,
    consistency: Consistency,
    element: &Component,
    he: &Component,
) -> Unavailability {
    match consistency {
        Consistency::WriteQuorum => write_quorum_unavailability(deployment, element),
        Consistency::ReadOnly => read_only_unavailability(deployment, element, he),
    }
}

/// The paper's bound on the probability of data loss, 1/4^Q (section 4.2), where data loss is
/// possible at all (Q ≤ ⌊N/2⌋).
pub fn paper_loss_bound(deployment: Deployment) -> Option<BigRational> {
    deployment.can_lose_data().then(|| BigRational::new(BigInt::one(), BigInt::from(4u32).pow(deployment.quorum())))
}

/// Where data loss is possible: the steady-state probability of the paper's loss condition, the
/// HE and the Q elements holding the latest acknowledged writes all down at once, x·p^Q. It is
/// the share of time during which a failover to the remaining (stale) elements would lose the
/// writes still in the failed HE's write queue.
pub fn loss_exposure(deployment: Deployment, element: &Component, he: &Component) -> Option<BigRational> {
    deployment.can_lose_data().then(|| he.down() * element.down().pow(exponent(deployment.quorum())))
}

fn exponent(k: u32) -> i32 {
    i32::try_from(k).expect("exponents are bounded by ELEMENTS_MAX")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ratio(numerator: i64, denominator: i64) -> BigRational {
        BigRational::new(numerator.into(), denominator.into())
    }

    fn element(availability: BigRational) -> Component {
        Component::from_availability(&availability).expect("valid availability")
    }

    /// The paper's Eq. 1 exactly as printed: A(Q,N) = Σ_{i=0..N−Q} C(N,i) ρⁱ / (1+ρ)^N.
    fn eq1_as_printed(n: u32, q: u32, rho: &BigRational) -> BigRational {
        let sum = (0..=n - q)
            .fold(BigRational::zero(), |acc, i| acc + BigRational::from_integer(binomial(n, i)) * rho.pow(exponent(i)));
        sum / (BigRational::one() + rho).pow(exponent(n))
    }

    /// The paper's Eq. 2 exactly as printed.
    fn eq2_as_printed(n: u32, q: u32, rho: &BigRational, rho_he: &BigRational) -> BigRational {
        let one = BigRational::one();
        let partial = |m: u32, upto: u32| {
            (0..=upto).fold(BigRational::zero(), |acc, i| {
                acc + BigRational::from_integer(binomial(m, i)) * rho.pow(exponent(i))
            })
        };
        partial(n, n - 1) / ((&one + rho_he) * (&one + rho).pow(exponent(n)))
            + rho_he * partial(q, q - 1) / ((&one + rho_he) * (&one + rho).pow(exponent(q)))
    }

    #[test]
    fn write_quorum_matches_eq1_as_printed() {
        #[track_caller]
        fn check(n: u32, q: u32, rho: BigRational) {
            let deployment = Deployment::new(n, q).expect("valid deployment");
            let component = Component::from_load(&rho).expect("valid load");
            let ours = write_quorum_unavailability(deployment, &component);
            assert_eq!(ours.availability(), eq1_as_printed(n, q, &rho), "N={n} Q={q} ρ={rho}");
        }
        for n in 1..=8 {
            for q in 1..=n {
                for rho in [ratio(1, 10), ratio(1, 1000), ratio(1, 1), ratio(7, 3), ratio(1, 99)] {
                    check(n, q, rho);
                }
            }
        }
    }

    #[test]
    fn read_only_matches_eq2_as_printed() {
        #[track_caller]
        fn check(n: u32, q: u32, rho: BigRational, rho_he: BigRational) {
            let deployment = Deployment::new(n, q).expect("valid deployment");
            let component = Component::from_load(&rho).expect("valid load");
            let he = Component::from_load(&rho_he).expect("valid load");
            let ours = read_only_unavailability(deployment, &component, &he);
            assert_eq!(ours.availability(), eq2_as_printed(n, q, &rho, &rho_he), "N={n} Q={q}");
        }
        for n in 1..=6 {
            for q in 1..=n {
                for (rho, rho_he) in [
                    (ratio(1, 10), ratio(1, 10)),
                    (ratio(1, 100), ratio(1, 10_000)),
                    (ratio(1, 1), ratio(1, 1)),
                    (ratio(1, 1), ratio(1, 1000)),
                ] {
                    check(n, q, rho, rho_he);
                }
            }
        }
    }

    #[test]
    fn closed_forms_by_hand() {
        // (N, Q, consistency, element availability, HE availability, unavailability)
        #[track_caller]
        fn check(n: u32, q: u32, c: Consistency, a: BigRational, b: BigRational, u: BigRational) {
            let deployment = Deployment::new(n, q).expect("valid deployment");
            let got = unavailability(deployment, c, &element(a), &element(b));
            assert_eq!(got.exact(), &u, "N={n} Q={q} {c:?}");
        }
        use Consistency::*;
        let he = ratio(9999, 10000);
        // one element: U = p
        check(1, 1, WriteQuorum, ratio(99, 100), he.clone(), ratio(1, 100));
        // Q = 1: all N down, p^N
        check(3, 1, WriteQuorum, ratio(99, 100), he.clone(), ratio(1, 1_000_000));
        // N = 3, Q = 2: 3p²(1−p) + p³ = 3·0.01·0.9 + 0.001
        check(3, 2, WriteQuorum, ratio(9, 10), he.clone(), ratio(28, 1000));
        // Q = N: 1 − (1−p)^N
        check(3, 3, WriteQuorum, ratio(9, 10), he.clone(), ratio(271, 1000));
        // read-only: (1−x)p^N + x·p^Q
        check(3, 2, ReadOnly, ratio(99, 100), ratio(99, 100), ratio(199, 100_000_000));
        check(3, 2, ReadOnly, ratio(99, 100), he.clone(), ratio(10099, 10_000_000_000));
        // read-only with Q = N does not depend on the HE: p^N
        check(3, 3, ReadOnly, ratio(9, 10), ratio(1, 2), ratio(1, 1000));
        // read-only with Q = 1: (1−x)p^N + x·p
        check(2, 1, ReadOnly, ratio(9, 10), ratio(9, 10), ratio(9 + 10, 1000));
    }

    #[test]
    fn exact_at_high_nines_where_floats_give_up() {
        // N = 7, Q = 1, A = 99.99 %: U = 10⁻²⁸, far below f64's resolution near 1.
        let deployment = Deployment::new(7, 1).expect("valid deployment");
        let u = write_quorum_unavailability(deployment, &element(ratio(9999, 10000)));
        assert_eq!(u.nines(), 28);
        assert_eq!(u.availability_f64(), 1.0, "availability alone cannot show it in an f64");
        let relative_error = (u.to_f64() - 1e-28).abs() / 1e-28;
        assert!(relative_error < 1e-15, "U as f64 is still accurate: {}", u.to_f64());
        // 1 − A in floating point would have said 0.
        assert_eq!(1.0 - (1.0 - 1e-28_f64), 0.0);
    }

    #[test]
    fn nines() {
        #[track_caller]
        fn check(u: BigRational, nines: u32, fractional: f64) {
            let u = Unavailability::new(u);
            assert_eq!(u.nines(), nines, "{:?}", u.exact());
            assert!((u.nines_fractional() - fractional).abs() < 1e-12, "{}", u.nines_fractional());
        }
        check(ratio(1, 10), 1, 1.0);
        check(ratio(1, 1_000_000), 6, 6.0);
        check(ratio(1_000_001, 1_000_000_000_000), 5, 6.0 - 1.000001f64.log10());
        check(ratio(5, 10_000), 3, 3.0 + 2f64.log10());
        check(ratio(1, 2), 0, 2f64.log10());
        check(ratio(1, 1), 0, 0.0);
        check(BigRational::new(1.into(), BigInt::from(10u32).pow(400)), 400, 400.0);
        assert_eq!(Unavailability::new(BigRational::zero()).nines(), u32::MAX);
    }

    #[test]
    fn meets_agrees_with_nines() {
        for u in [ratio(1, 1000), ratio(1001, 1_000_000), ratio(999, 1_000_000), ratio(3, 10)] {
            let u = Unavailability::new(u);
            for k in 0..8 {
                assert_eq!(u.meets(k), k <= u.nines(), "{:?} {k}", u.exact());
            }
        }
    }

    #[test]
    fn downtime() {
        let u = Unavailability::new(ratio(1, 1_000_000));
        assert!((u.downtime_minutes_per_year() - 0.52596).abs() < 1e-12);
    }

    #[test]
    fn deployment_bounds() {
        #[track_caller]
        fn check(n: u32, q: u32, expected: Result<(), ModelError>) {
            assert_eq!(Deployment::new(n, q).map(|_| ()), expected);
        }
        check(1, 1, Ok(()));
        check(3, 2, Ok(()));
        check(ELEMENTS_MAX, ELEMENTS_MAX, Ok(()));
        check(0, 0, Err(ModelError::NoElements));
        check(3, 0, Err(ModelError::QuorumOutOfRange { quorum: 0, elements: 3 }));
        check(3, 4, Err(ModelError::QuorumOutOfRange { quorum: 4, elements: 3 }));
        check(65, 1, Err(ModelError::TooManyElements { elements: 65, max: ELEMENTS_MAX }));
    }

    #[test]
    fn component_bounds() {
        assert!(Component::from_availability(&ratio(0, 1)).is_err());
        assert!(Component::from_availability(&ratio(1, 1)).is_err());
        assert!(Component::from_availability(&ratio(-1, 2)).is_err());
        assert!(Component::from_availability(&ratio(3, 2)).is_err());
        assert!(Component::from_availability_read(&ratio(1, 1), Reading::PaperLoad).is_err());
        assert!(Component::from_load(&ratio(0, 1)).is_err());
        assert!(Component::from_rates(&ratio(0, 1), &ratio(1, 1)).is_err());
        assert!(Component::from_rates(&ratio(1, 1), &ratio(-1, 1)).is_err());
        // ρ ≥ 1 is a valid (if poor) component: Eq. 1 holds for any ρ with independent repair.
        assert_eq!(Component::from_load(&ratio(3, 1)).expect("valid").down(), &ratio(3, 4));
    }

    #[test]
    fn readings_and_rates_agree() {
        let paper = Component::from_availability_read(&ratio(99, 100), Reading::PaperLoad).expect("valid");
        assert_eq!(paper.load(), ratio(1, 100));
        assert_eq!(paper.down(), &ratio(1, 101));
        let rates = Component::from_rates(&ratio(1, 100), &ratio(1, 1)).expect("valid");
        assert_eq!(rates, paper);
        let exact = Component::from_availability_read(&ratio(99, 100), Reading::Exact).expect("valid");
        assert_eq!(exact.load(), ratio(1, 99));
    }

    #[test]
    fn reliability() {
        #[track_caller]
        fn check(n: u32, q: u32, can_lose: bool, bound: Option<BigRational>) {
            let deployment = Deployment::new(n, q).expect("valid deployment");
            assert_eq!(deployment.can_lose_data(), can_lose, "N={n} Q={q}");
            assert_eq!(paper_loss_bound(deployment), bound, "N={n} Q={q}");
        }
        check(1, 1, false, None);
        check(2, 1, true, Some(ratio(1, 4)));
        check(3, 1, true, Some(ratio(1, 4)));
        check(3, 2, false, None);
        check(4, 2, true, Some(ratio(1, 16)));
        check(5, 3, false, None);
        check(6, 3, true, Some(ratio(1, 64)));
        let deployment = Deployment::new(3, 1).expect("valid deployment");
        let exposure = loss_exposure(deployment, &element(ratio(99, 100)), &element(ratio(9, 10)));
        assert_eq!(exposure, Some(ratio(1, 1000)), "x·p^Q = 0.1·0.01");
    }
}
