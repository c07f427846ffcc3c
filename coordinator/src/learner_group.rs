//! The learner ranks' rendezvous (the `LearnerGroup` service): rank 0 publishes how to
//! join its collective, the other ranks long-poll for it. One slot per group (the learner
//! ranks, "", and the weight receivers, "weights") per coordinator (one run); the newest
//! publish wins.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tutor_proto::learner_group_server::LearnerGroup;
use tutor_proto::{
    CollectiveKind, GetRendezvousRequest, PublishRendezvousRequest, PublishRendezvousResponse,
    Rendezvous,
};

/// The longest a GetRendezvous call is held open; clients call again.
pub const MAX_WAIT: Duration = Duration::from_secs(30);
/// Largest world size accepted (a typo like 80000 should not look valid).
const MAX_WORLD_SIZE: u32 = 4096;

/// The current rendezvous of each group rank 0 has published. The watch channel is their
/// one owner; callers wait on it for a newer generation.
#[derive(Clone)]
pub struct LearnerGroupService {
    current: watch::Sender<BTreeMap<String, Rendezvous>>,
}

impl Default for LearnerGroupService {
    fn default() -> Self {
        Self {
            current: watch::channel(BTreeMap::new()).0,
        }
    }
}

/// How a group is named in messages.
fn describe(group: &str) -> String {
    if group.is_empty() {
        "learner rank 0".into()
    } else {
        format!("learner rank 0 (group {group:?})")
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn validate(r: &Rendezvous) -> Result<(), Status> {
    if r.group.len() > 64
        || !r
            .group
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return Err(Status::invalid_argument(format!(
            "rendezvous group must be at most 64 characters of a-z, 0-9, _ and -, got {:?}",
            r.group
        )));
    }
    if r.world_size < 2 || r.world_size > MAX_WORLD_SIZE {
        return Err(Status::invalid_argument(format!(
            "rendezvous world_size must be 2..={MAX_WORLD_SIZE} (one rank needs no rendezvous), got {}",
            r.world_size
        )));
    }
    match CollectiveKind::try_from(r.kind) {
        Ok(CollectiveKind::Cpu) if r.cpu_address.is_empty() || r.cpu_address.len() > 256 => Err(
            Status::invalid_argument("a CPU rendezvous needs cpu_address (host:port of rank 0)"),
        ),
        Ok(CollectiveKind::Cpu) => Ok(()),
        Ok(CollectiveKind::Nccl) if r.nccl_unique_id.len() != 128 => {
            Err(Status::invalid_argument(format!(
                "an NCCL rendezvous needs the 128-byte nccl_unique_id, got {} bytes",
                r.nccl_unique_id.len()
            )))
        }
        Ok(CollectiveKind::Nccl) => Ok(()),
        _ => Err(Status::invalid_argument(
            "rendezvous kind must be COLLECTIVE_KIND_CPU or COLLECTIVE_KIND_NCCL",
        )),
    }
}

#[tonic::async_trait]
impl LearnerGroup for LearnerGroupService {
    async fn publish_rendezvous(
        &self,
        request: Request<PublishRendezvousRequest>,
    ) -> Result<Response<PublishRendezvousResponse>, Status> {
        // Rank 0 of every group published here is the learner's (its ranks' group, the
        // weights broadcast): a worker's token fetches rendezvous, never publishes one (it
        // would point the learner's ranks or the other workers at its own address).
        if let Some(tutor_proto::auth::CallerRole(role @ tutor_proto::auth::Role::Worker)) =
            request.extensions().get().copied()
        {
            return Err(Status::permission_denied(format!(
                "a {} token may not publish a rendezvous: only learner rank 0 does (it may \
                 fetch one)",
                role.as_str()
            )));
        }
        let mut r = request
            .into_inner()
            .rendezvous
            .ok_or_else(|| Status::invalid_argument("PublishRendezvous needs a rendezvous"))?;
        validate(&r)?;
        let mut generation = 0;
        let who = describe(&r.group);
        self.current.send_modify(|cur| {
            let last = cur.values().map(|c| c.generation).max().unwrap_or(0);
            // Above the last one, and above any a previous coordinator handed out.
            generation = (last + 1).max(now_ms());
            r.generation = generation;
            cur.insert(r.group.clone(), r);
        });
        tracing::info!(generation, "{who} published its rendezvous");
        Ok(Response::new(PublishRendezvousResponse { generation }))
    }

    async fn get_rendezvous(
        &self,
        request: Request<GetRendezvousRequest>,
    ) -> Result<Response<Rendezvous>, Status> {
        let r = request.into_inner();
        let wait = Duration::from_millis(r.wait_ms as u64).min(MAX_WAIT);
        let mut rx = self.current.subscribe();
        let newer = |c: &BTreeMap<String, Rendezvous>| {
            c.get(&r.group)
                .is_some_and(|c| c.generation > r.after_generation)
        };
        let found = tokio::time::timeout(wait, rx.wait_for(newer)).await;
        let who = describe(&r.group);
        match found {
            Ok(Ok(c)) => Ok(Response::new(
                c.get(&r.group).cloned().expect("checked by wait_for"),
            )),
            Ok(Err(_)) => Err(Status::unavailable("the coordinator is shutting down")),
            Err(_) => Err(Status::not_found(if r.after_generation == 0 {
                format!("no {who} has published a rendezvous yet")
            } else {
                format!(
                    "no {who} has published a rendezvous newer than generation {}",
                    r.after_generation
                )
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(addr: &str) -> Rendezvous {
        Rendezvous {
            generation: 0,
            world_size: 2,
            kind: CollectiveKind::Cpu as i32,
            cpu_address: addr.into(),
            nccl_unique_id: Vec::new(),
            group: String::new(),
        }
    }

    async fn get(s: &LearnerGroupService, after: u64, wait_ms: u32) -> Result<Rendezvous, Status> {
        get_group(s, "", after, wait_ms).await
    }

    async fn get_group(
        s: &LearnerGroupService,
        group: &str,
        after: u64,
        wait_ms: u32,
    ) -> Result<Rendezvous, Status> {
        s.get_rendezvous(Request::new(GetRendezvousRequest {
            after_generation: after,
            wait_ms,
            group: group.into(),
        }))
        .await
        .map(|r| r.into_inner())
    }

    /// The learner ranks' group and the weight receivers' group are separate slots: a
    /// publish in one neither answers nor replaces the other.
    #[tokio::test]
    async fn groups_have_separate_slots() {
        let s = LearnerGroupService::default();
        let ranks = publish(&s, cpu("127.0.0.1:9")).await.unwrap();
        let e = get_group(&s, "weights", 0, 10).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("\"weights\""), "{e}");
        let mut w = cpu("127.0.0.1:11");
        w.group = "weights".into();
        let weights = publish(&s, w).await.unwrap();
        assert!(weights > ranks, "generations grow across groups");
        assert_eq!(
            get_group(&s, "weights", 0, 10).await.unwrap().cpu_address,
            "127.0.0.1:11"
        );
        let r = get(&s, 0, 10).await.unwrap();
        assert_eq!(
            (r.generation, r.cpu_address.as_str()),
            (ranks, "127.0.0.1:9")
        );
        let mut bad = cpu("127.0.0.1:12");
        bad.group = "Weights!".into();
        assert_eq!(
            publish(&s, bad).await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }

    async fn publish(s: &LearnerGroupService, r: Rendezvous) -> Result<u64, Status> {
        s.publish_rendezvous(Request::new(PublishRendezvousRequest {
            rendezvous: Some(r),
        }))
        .await
        .map(|r| r.into_inner().generation)
    }

    #[tokio::test]
    async fn waiters_get_the_published_rendezvous_and_newer_generations() {
        let s = LearnerGroupService::default();
        let e = get(&s, 0, 10).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("no learner rank 0"), "{e}");

        let waiter = {
            let s = s.clone();
            tokio::spawn(async move { get(&s, 0, 10_000).await })
        };
        let g1 = publish(&s, cpu("127.0.0.1:9")).await.unwrap();
        let got = waiter.await.unwrap().unwrap();
        assert_eq!(
            (got.generation, got.cpu_address.as_str()),
            (g1, "127.0.0.1:9")
        );

        // A rank that lost generation g1 waits for a newer one.
        assert_eq!(
            get(&s, g1, 10).await.unwrap_err().code(),
            tonic::Code::NotFound
        );
        let g2 = publish(&s, cpu("127.0.0.1:10")).await.unwrap();
        assert!(g2 > g1);
        assert_eq!(get(&s, g1, 10).await.unwrap().cpu_address, "127.0.0.1:10");
        assert_eq!(get(&s, 0, 10).await.unwrap().generation, g2);
    }

    #[tokio::test]
    async fn malformed_rendezvous_are_refused() {
        let s = LearnerGroupService::default();
        let mut bad = cpu("");
        assert!(publish(&s, bad.clone()).await.is_err());
        bad.cpu_address = "127.0.0.1:9".into();
        bad.world_size = 1;
        assert!(publish(&s, bad.clone()).await.is_err());
        bad.world_size = 2;
        bad.kind = CollectiveKind::Nccl as i32;
        bad.nccl_unique_id = vec![0; 12];
        let e = publish(&s, bad).await.unwrap_err();
        assert!(e.message().contains("128"), "{e}");
    }
}
