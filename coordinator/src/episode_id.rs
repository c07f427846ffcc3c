//! Episode ids: the iteration, slot and attempt an episode was leased for, and their
//! string form on the wire and in the trajectory store (`it000-train0002-g0a1`).

use std::fmt;
use std::str::FromStr;

use tutor_proto::EpisodePurpose;

/// What an episode is for: training (its turns go into the dataset) or held-out
/// evaluation (the student alone, never trained on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Purpose {
    Train,
    Eval,
}

impl Purpose {
    fn as_str(self) -> &'static str {
        match self {
            Purpose::Train => "train",
            Purpose::Eval => "eval",
        }
    }
}

impl From<Purpose> for EpisodePurpose {
    fn from(p: Purpose) -> Self {
        match p {
            Purpose::Train => EpisodePurpose::Train,
            Purpose::Eval => EpisodePurpose::Eval,
        }
    }
}

/// One planned episode of an iteration, whichever attempt runs it: `it000-train0002`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    pub iteration: u32,
    pub purpose: Purpose,
    /// Index into the iteration's slots (training and held-out slots share the count).
    pub slot: usize,
}

/// One leased attempt at a slot: `it000-train0002-g0a1`. The generation (the how-many-th
/// start of the coordinator on this run directory) keeps ids unique across restarts; the
/// attempt counts the leases of the slot that expired, or were withdrawn before any worker
/// had them, before this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EpisodeId {
    pub slot: SlotId,
    pub generation: u64,
    pub attempt: u32,
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "it{:03}-{}{:04}",
            self.iteration,
            self.purpose.as_str(),
            self.slot
        )
    }
}

impl fmt::Display for EpisodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-g{}a{}", self.slot, self.generation, self.attempt)
    }
}

/// A string that is not an episode id a coordinator leased.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "episode id {id:?} was not made by a coordinator: expected \
     it<iteration>-<train|eval><slot>-g<generation>a<attempt> as a lease carries it, \
     e.g. \"it000-train0002-g0a1\"; send the episode_id of the lease unchanged"
)]
pub struct ParseEpisodeIdError {
    pub id: String,
}

impl FromStr for EpisodeId {
    type Err = ParseEpisodeIdError;

    /// Accepts exactly the strings `Display` makes: two spellings of one id would be two
    /// episodes in the store (keyed by the string) but one here.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match parse(s) {
            Some(id) if id.to_string() == s => Ok(id),
            _ => Err(ParseEpisodeIdError { id: s.to_string() }),
        }
    }
}

fn parse(s: &str) -> Option<EpisodeId> {
    let mut parts = s.splitn(3, '-');
    let iteration = parts.next()?.strip_prefix("it")?.parse().ok()?;
    let slot = parts.next()?;
    let (purpose, slot) = match slot.strip_prefix("train") {
        Some(n) => (Purpose::Train, n),
        None => (Purpose::Eval, slot.strip_prefix("eval")?),
    };
    let (generation, attempt) = parts.next()?.strip_prefix('g')?.split_once('a')?;
    Some(EpisodeId {
        slot: SlotId {
            iteration,
            purpose,
            slot: slot.parse().ok()?,
        },
        generation: generation.parse().ok()?,
        attempt: attempt.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_keep_their_stored_string_form() {
        for s in [
            "it000-train0002-g0a1",
            "it012-eval0000-g3a0",
            "it1000-train12345-g10a7",
        ] {
            let id: EpisodeId = s.parse().unwrap();
            assert_eq!(id.to_string(), s);
        }
        let id: EpisodeId = "it001-eval0003-g2a4".parse().unwrap();
        assert_eq!(
            id,
            EpisodeId {
                slot: SlotId {
                    iteration: 1,
                    purpose: Purpose::Eval,
                    slot: 3
                },
                generation: 2,
                attempt: 4
            }
        );
        assert_eq!(id.slot.to_string(), "it001-eval0003");
    }

    #[test]
    fn strings_a_coordinator_does_not_make_are_refused() {
        for s in [
            "e1",
            "it000-train0000",
            "it000-test0000-g0a0",
            "it0-train0-g0a0",
            "it000-train0000-g0a0x",
            "it000-train0000-g0",
        ] {
            let err = s.parse::<EpisodeId>().unwrap_err();
            assert!(err.to_string().contains("it000-train0002-g0a1"), "{err}");
        }
    }
}
