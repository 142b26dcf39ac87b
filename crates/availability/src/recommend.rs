//! Sizing: the smallest N, then the smallest Q, that reach a target count of nines, with a
//! write quorum (Eq. 1) and with read-only consistency (Eq. 2), each also among the
//! deployments that cannot lose data (Q > ⌊N/2⌋).

use crate::model::{
    read_only_unavailability, unavailability, write_quorum_unavailability, Component, Consistency, Deployment,
    Unavailability, ELEMENTS_MAX,
};

/// Largest target accepted, in nines.
pub const TARGET_NINES_MAX: u32 = 30;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecommendError {
    #[error("the target must be between 1 and {TARGET_NINES_MAX} nines, got {0}")]
    TargetOutOfRange(u32),
}

/// What to search for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Goal {
    pub consistency: Consistency,
    /// Only deployments that cannot lose data (Q > ⌊N/2⌋).
    pub loss_free: bool,
}

/// The four goals, in the order they are reported.
pub const GOALS: [Goal; 4] = [
    Goal { consistency: Consistency::WriteQuorum, loss_free: false },
    Goal { consistency: Consistency::WriteQuorum, loss_free: true },
    Goal { consistency: Consistency::ReadOnly, loss_free: false },
    Goal { consistency: Consistency::ReadOnly, loss_free: true },
];

#[derive(Debug, Clone)]
pub struct Choice {
    pub deployment: Deployment,
    /// With a write quorum (Eq. 1): how often writes are possible.
    pub write_quorum: Unavailability,
    /// With read-only consistency (Eq. 2): how often reads are possible.
    pub read_only: Unavailability,
}

#[derive(Debug, Clone)]
pub struct Recommendation {
    pub goal: Goal,
    /// `None` if no deployment with at most [`ELEMENTS_MAX`] elements reaches the target.
    pub choice: Option<Choice>,
}

/// For each of [`GOALS`], the smallest (N, Q) in lexicographic order whose availability under the
/// goal's consistency has at least `target_nines` nines.
pub fn recommend(
    target_nines: u32,
    element: &Component,
    he: &Component,
) -> Result<Vec<Recommendation>, RecommendError> {
    if target_nines == 0 || target_nines > TARGET_NINES_MAX {
        return Err(RecommendError::TargetOutOfRange(target_nines));
    }
    Ok(GOALS.iter().map(|&goal| Recommendation { goal, choice: search(goal, target_nines, element, he) }).collect())
}

fn search(goal: Goal, target_nines: u32, element: &Component, he: &Component) -> Option<Choice> {
    for elements in 1..=ELEMENTS_MAX {
        let quorum_min = if goal.loss_free { elements / 2 + 1 } else { 1 };
        // Eq. 1 only gets worse as Q grows and Eq. 2 only better, so one evaluation tells
        // whether this N has any Q that reaches the target.
        let quorum_best = match goal.consistency {
            Consistency::WriteQuorum => quorum_min,
            Consistency::ReadOnly => elements,
        };
        if !meets(goal, elements, quorum_best, target_nines, element, he) {
            continue;
        }
        let quorum = (quorum_min..=quorum_best)
            .find(|&quorum| meets(goal, elements, quorum, target_nines, element, he))
            .expect("quorum_best meets the target");
        let deployment = Deployment::new(elements, quorum).expect("1 ≤ Q ≤ N ≤ ELEMENTS_MAX");
        return Some(Choice {
            deployment,
            write_quorum: write_quorum_unavailability(deployment, element),
            read_only: read_only_unavailability(deployment, element, he),
        });
    }
    None
}

fn meets(goal: Goal, elements: u32, quorum: u32, target_nines: u32, element: &Component, he: &Component) -> bool {
    let deployment = Deployment::new(elements, quorum).expect("1 ≤ Q ≤ N ≤ ELEMENTS_MAX");
    unavailability(deployment, goal.consistency, element, he).meets(target_nines)
}

#[cfg(test)]
mod tests {
    use num_rational::BigRational;

    use super::*;

    fn component(numerator: i64, denominator: i64) -> Component {
        Component::from_availability(&BigRational::new(numerator.into(), denominator.into()))
            .expect("valid availability")
    }

    /// Brute force over every (N, Q) up to `n_max`, smallest first.
    fn brute_force(goal: Goal, target: u32, element: &Component, he: &Component, n_max: u32) -> Option<(u32, u32)> {
        (1..=n_max).flat_map(|n| (1..=n).map(move |q| (n, q))).filter(|&(n, q)| !goal.loss_free || q > n / 2).find(
            |&(n, q)| {
                let deployment = Deployment::new(n, q).expect("valid");
                unavailability(deployment, goal.consistency, element, he).meets(target)
            },
        )
    }

    #[test]
    fn smallest_n_then_q() {
        // (target, element, HE, expected (N, Q) per goal in GOALS order)
        #[track_caller]
        fn check(target: u32, element: Component, he: Component, expected: [(u32, u32); 4]) {
            let got: Vec<(u32, u32)> = recommend(target, &element, &he)
                .expect("valid target")
                .iter()
                .map(|r| {
                    let d = r.choice.as_ref().expect("reachable").deployment;
                    (d.elements(), d.quorum())
                })
                .collect();
            assert_eq!(got, expected, "target {target}");
        }
        // 99 % elements, 6 nines: p³ = 10⁻⁶ exactly, so N = 3 with Q = 1 just makes it.
        // Loss-free, Q = ⌊N/2⌋+1: N = 5, Q = 3 gives 9.85·10⁻⁶, N = 6, Q = 4 gives 1.94·10⁻⁵,
        // N = 7, Q = 4 gives 3.4·10⁻⁷.
        // Read-only, HE 99 %: (1−x)p³ + x·p^Q is 10⁻⁶ only at Q = 3.
        check(6, component(99, 100), component(99, 100), [(3, 1), (7, 4), (3, 3), (3, 3)]);
        // 5 nines, HE 99.99 % (x = 10⁻⁴): read-only N = 3 reaches it with Q = 1,
        // (1−x)·10⁻⁶ + x·10⁻² ≈ 2·10⁻⁶, and loss-free with Q = 2; a loss-free write quorum
        // needs N = 5, Q = 3 (9.85·10⁻⁶), since N = 3, Q = 2 gives 2.98·10⁻⁴.
        check(5, component(99, 100), component(9999, 10000), [(3, 1), (5, 3), (3, 1), (3, 2)]);
        check(2, component(9, 10), component(9, 10), [(2, 1), (5, 3), (2, 2), (2, 2)]);
    }

    #[test]
    fn agrees_with_brute_force() {
        const N_MAX: u32 = 12;
        let elements = [component(9, 10), component(99, 100), component(3, 4)];
        let hes = [component(9, 10), component(9999, 10000)];
        for element in &elements {
            for he in &hes {
                for target in 1..=7 {
                    for recommendation in recommend(target, element, he).expect("valid") {
                        let got = recommendation.choice.map(|c| (c.deployment.elements(), c.deployment.quorum()));
                        let expected = brute_force(recommendation.goal, target, element, he, N_MAX);
                        if got.is_some_and(|(n, _)| n <= N_MAX) || expected.is_some() {
                            assert_eq!(got, expected, "{:?} target {target}", recommendation.goal);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn loss_free_choices_cannot_lose_data() {
        for recommendation in recommend(7, &component(99, 100), &component(99, 100)).expect("valid") {
            let choice = recommendation.choice.expect("reachable");
            if recommendation.goal.loss_free {
                assert!(!choice.deployment.can_lose_data());
            }
        }
    }

    #[test]
    fn unreachable_and_bad_targets() {
        let poor = component(1, 10);
        let recommendations = recommend(30, &poor, &poor).expect("valid target");
        assert!(recommendations.iter().all(|r| r.choice.is_none()));
        assert_eq!(recommend(0, &poor, &poor).err(), Some(RecommendError::TargetOutOfRange(0)));
        assert_eq!(recommend(31, &poor, &poor).err(), Some(RecommendError::TargetOutOfRange(31)));
    }
}
