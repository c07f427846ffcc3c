//! Who acts at each turn of an episode (DAgger mixing, β per turn or κ per trajectory).
//!
//! Turn level: the teacher with probability β, the student otherwise. Trajectory level:
//! the student for the first κ turns, the teacher after. The teacher labels every state
//! either way; this only says whose action is executed and whether the student is asked.

use rand::Rng;
use tutor_proto::{Actor, EpisodeLease};

/// A lease's mixing rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mixing {
    /// Turn level: at every turn the teacher's action with probability `beta`, else the
    /// student's (β = 1 is behaviour cloning: the student is never asked).
    Turn { beta: f64 },
    /// Trajectory level: the student acts for the first `student_turns` (κ) turns, the
    /// teacher completes the episode; β plays no part.
    Trajectory { student_turns: u32 },
}

/// What one turn needs from the student, and whose action it executes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnRoles {
    /// The student generates a proposal this turn (it may be executed; when it is not, it
    /// still gives agreement metrics and, for distillation, tokens to score).
    pub student_generates: bool,
    /// Whose action is executed (the student only when it generates).
    pub executes: Actor,
}

impl Mixing {
    /// The rule a lease asks for: trajectory level when it sets `student_turns`, else turn
    /// level with its β clamped to [0, 1].
    pub fn from_lease(lease: &EpisodeLease) -> Self {
        match lease.student_turns {
            Some(student_turns) => Mixing::Trajectory { student_turns },
            None => Mixing::Turn {
                beta: lease.beta.clamp(0.0, 1.0),
            },
        }
    }

    /// Who acts at turn `turn` (0-based). Turn level with β < 1 draws one number from
    /// `rng` per turn; β = 1 and trajectory level draw nothing, so the draws (and a seeded
    /// episode) do not depend on anything else.
    pub fn roles(&self, turn: u32, rng: &mut impl Rng) -> TurnRoles {
        let student = TurnRoles {
            student_generates: true,
            executes: Actor::Student,
        };
        let teacher_alone = TurnRoles {
            student_generates: false,
            executes: Actor::Teacher,
        };
        match *self {
            Mixing::Trajectory { student_turns } if turn < student_turns => student,
            Mixing::Trajectory { .. } => teacher_alone,
            Mixing::Turn { beta } if beta < 1.0 => {
                if rng.gen::<f64>() < beta {
                    TurnRoles {
                        student_generates: true,
                        executes: Actor::Teacher,
                    }
                } else {
                    student
                }
            }
            // β = 1 (or NaN): the student is not asked.
            Mixing::Turn { .. } => teacher_alone,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn run(m: Mixing, turns: u32, seed: u64) -> Vec<TurnRoles> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..turns).map(|t| m.roles(t, &mut rng)).collect()
    }

    fn teacher_share(roles: &[TurnRoles]) -> f64 {
        let n = roles
            .iter()
            .filter(|r| r.executes == Actor::Teacher)
            .count();
        n as f64 / roles.len() as f64
    }

    #[test]
    fn beta_one_is_always_the_teacher_and_never_asks_the_student() {
        let roles = run(Mixing::Turn { beta: 1.0 }, 1000, 3);
        assert!(roles
            .iter()
            .all(|r| r.executes == Actor::Teacher && !r.student_generates));
    }

    #[test]
    fn beta_zero_is_always_the_student() {
        let roles = run(Mixing::Turn { beta: 0.0 }, 1000, 3);
        assert!(roles
            .iter()
            .all(|r| r.executes == Actor::Student && r.student_generates));
    }

    #[test]
    fn beta_is_the_teachers_share_of_turns() {
        let roles = run(Mixing::Turn { beta: 0.3 }, 10_000, 7);
        let share = teacher_share(&roles);
        assert!(
            (share - 0.3).abs() < 0.02,
            "teacher acted on {share} of turns"
        );
        // The student is asked on every turn, executed or not.
        assert!(roles.iter().all(|r| r.student_generates));
    }

    #[test]
    fn kappa_boundary_is_exact() {
        let roles = run(Mixing::Trajectory { student_turns: 3 }, 8, 1);
        for (t, r) in roles.iter().enumerate() {
            let want = if t < 3 {
                (Actor::Student, true)
            } else {
                (Actor::Teacher, false)
            };
            assert_eq!((r.executes, r.student_generates), want, "turn {t}");
        }
        // κ = 0 is the teacher throughout, like β = 1.
        assert_eq!(
            run(Mixing::Trajectory { student_turns: 0 }, 5, 1),
            run(Mixing::Turn { beta: 1.0 }, 5, 1)
        );
    }

    #[test]
    fn the_same_seed_gives_the_same_choices() {
        let m = Mixing::Turn { beta: 0.5 };
        assert_eq!(run(m, 200, 42), run(m, 200, 42));
        assert_ne!(run(m, 200, 42), run(m, 200, 43));
    }

    #[test]
    fn only_turn_level_mixing_below_one_draws() {
        // What the episode relies on to keep seeded runs reproducible: one draw per turn
        // exactly when β < 1 at turn level, none otherwise.
        let untouched = ChaCha8Rng::seed_from_u64(5);
        for m in [
            Mixing::Turn { beta: 1.0 },
            Mixing::Turn { beta: f64::NAN },
            Mixing::Trajectory { student_turns: 2 },
        ] {
            let mut rng = untouched.clone();
            for t in 0..4 {
                m.roles(t, &mut rng);
            }
            assert_eq!(rng, untouched, "{m:?}");
        }
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut reference = ChaCha8Rng::seed_from_u64(5);
        Mixing::Turn { beta: 0.4 }.roles(0, &mut rng);
        let _: f64 = reference.gen();
        assert_eq!(rng, reference);
    }

    #[test]
    fn a_lease_picks_its_rule() {
        let mut lease = EpisodeLease {
            beta: 1.7,
            ..Default::default()
        };
        assert_eq!(Mixing::from_lease(&lease), Mixing::Turn { beta: 1.0 });
        lease.student_turns = Some(4);
        assert_eq!(
            Mixing::from_lease(&lease),
            Mixing::Trajectory { student_turns: 4 }
        );
    }
}
