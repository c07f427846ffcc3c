//! The weight-update groups `tutor serve` is a rank of (`--distributed-updates`): SGLang's
//! `init_weights_update_group` forms one, `update_weights_from_distributed` receives over
//! it, `destroy_weights_update_group` closes it (routes in `native.rs`).

use tutor_collective::CpuCollective;

/// Most weight-update groups open at once (one per worker using this engine, during a
/// reload). Beyond it the group idle longest is closed: one its client never destroyed
/// (it crashed, or its destroy was lost) must not block every later update.
const MAX_UPDATE_GROUPS: usize = 64;

/// The weight-update groups this server is a rank of: idle ones by name, with the order
/// they were formed in, and the names of those receiving an update now (their
/// collective is with the receiving task; a destroy meanwhile closes it when it is done).
#[derive(Default)]
pub(crate) struct UpdateGroups {
    formed: u64,
    idle: std::collections::HashMap<String, (u64, CpuCollective)>,
    busy: std::collections::HashSet<String>,
}

impl UpdateGroups {
    pub(super) fn contains(&self, name: &str) -> bool {
        self.idle.contains_key(name) || self.busy.contains(name)
    }

    /// Room for one more group: the one idle longest is closed when all are taken; an
    /// error when every group is receiving.
    pub(super) fn make_room(&mut self) -> Result<(), String> {
        if self.idle.len() + self.busy.len() < MAX_UPDATE_GROUPS {
            return Ok(());
        }
        let oldest = self
            .idle
            .iter()
            .min_by_key(|(_, (formed, _))| *formed)
            .map(|(name, _)| name.clone());
        match oldest {
            Some(name) => {
                tracing::warn!(group = %name, "{MAX_UPDATE_GROUPS} weight-update groups are open: closing the one idle longest");
                self.idle.remove(&name);
                Ok(())
            }
            None => Err(format!(
                "{MAX_UPDATE_GROUPS} weight-update groups are receiving updates: try again later"
            )),
        }
    }

    pub(super) fn insert(&mut self, name: String, collective: CpuCollective) {
        self.formed += 1;
        self.idle.insert(name, (self.formed, collective));
    }

    /// The group's collective, for an update to receive over; `None` if there is no
    /// idle group of that name.
    pub(super) fn take(&mut self, name: &str) -> Option<CpuCollective> {
        let (_, c) = self.idle.remove(name)?;
        self.busy.insert(name.to_string());
        Some(c)
    }

    /// An update over `name` is done: the group is idle again, unless it was destroyed
    /// meanwhile (then `collective` is dropped, closing it).
    pub(super) fn give_back(&mut self, name: &str, collective: CpuCollective) {
        if self.busy.remove(name) {
            self.insert(name.to_string(), collective);
        }
    }

    /// An update over `name` failed: the group is closed.
    pub(super) fn lose(&mut self, name: &str) {
        self.busy.remove(name);
    }

    /// Closes the group (at once when idle, when its update ends when busy); false if
    /// there is none of that name.
    pub(super) fn destroy(&mut self, name: &str) -> bool {
        self.idle.remove(name).is_some() || self.busy.remove(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups whose clients never destroyed them do not block later ones: at the limit
    /// the one idle longest is closed. A group destroyed while it receives is closed
    /// when the update ends, not put back.
    #[test]
    fn leaked_groups_make_room_and_a_destroy_during_an_update_closes_the_group() {
        let mut g = UpdateGroups::default();
        for i in 0..MAX_UPDATE_GROUPS {
            assert!(g.make_room().is_ok());
            g.insert(format!("g{i}"), CpuCollective::solo());
        }
        let busy = g.take("g0").expect("g0 is idle");
        assert!(g.make_room().is_ok(), "an idle group is closed for room");
        assert!(!g.contains("g1"), "g1, idle longest, was closed");
        assert!(g.contains("g0") && g.contains("g2"));
        g.insert("new".into(), CpuCollective::solo());

        // Destroyed while busy: closed when its update gives it back.
        assert!(g.destroy("g0"));
        g.give_back("g0", busy);
        assert!(!g.contains("g0"));
        assert!(!g.destroy("g0"), "destroyed already");

        // Every group receiving: no room, and the error says so.
        let mut all_busy = UpdateGroups::default();
        for i in 0..MAX_UPDATE_GROUPS {
            all_busy.insert(format!("b{i}"), CpuCollective::solo());
            let _ = all_busy.take(&format!("b{i}"));
        }
        let err = all_busy.make_room().unwrap_err();
        assert!(err.contains("receiving"), "{err}");
    }
}
