//! The rendezvous of a group of processes through the coordinator's LearnerGroup
//! service: rank 0 publishes how to reach it (the CPU collective's address or the NCCL
//! unique id) under a group name and a generation; the other ranks long-poll for a
//! generation newer than the one they lost and join it. Groups: "" (the learner's
//! data-parallel ranks) and `broadcast::GROUP` (learner rank 0 and the weight receivers).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tonic::{Code, Request};
use tutor_proto::auth::ClientAuth;
use tutor_proto::learner_group_client::LearnerGroupClient;
use tutor_proto::{CollectiveKind, GetRendezvousRequest, PublishRendezvousRequest, Rendezvous};

use crate::{Collective, CollectiveSecret, CpuCollective, CpuCollectiveTimeouts, CpuRendezvous};

/// Which collective a group uses (`[learner] collective`, `broadcast_collective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveChoice {
    #[default]
    Cpu,
    Nccl,
}

/// Deadline of one call to the coordinator (a GetRendezvous long poll adds its wait).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator holds one GetRendezvous open.
const POLL_WAIT: Duration = Duration::from_secs(10);

/// One rank's place in the group and how to reach the others.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    pub rank: usize,
    pub world_size: usize,
    pub collective: CollectiveChoice,
    /// The coordinator's gRPC endpoint (`http://host:port`), where the rendezvous is.
    pub coordinator: String,
    /// Token and TLS for the calls to the coordinator; the token also keys the CPU
    /// collective's hello (see `secret`).
    pub auth: ClientAuth,
    /// CPU, rank 0: where its collective listens (port 0: any free port).
    pub collective_listen: SocketAddr,
    /// CPU, rank 0: the host:port the other ranks connect to (default: the bound
    /// address; required when listening on 0.0.0.0).
    pub collective_advertise: Option<String>,
    /// NCCL: this rank's CUDA device.
    pub gpu: usize,
    pub rendezvous_timeout: Duration,
    pub collective_timeout: Duration,
    /// The rendezvous slot at the coordinator: "" for the learner ranks,
    /// `broadcast::GROUP` for learner rank 0 and the workers it pushes weights to.
    pub group: String,
}

impl GroupOptions {
    /// How often rank 0 sends a keepalive while no batch comes, so that the other ranks'
    /// wait for the next message (bounded by `collective_timeout`) does not run out.
    pub fn keepalive(&self) -> Duration {
        (self.collective_timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(10))
    }

    /// This process in messages.
    pub fn who(&self) -> String {
        if self.group.is_empty() {
            format!("learner rank {} of {}", self.rank, self.world_size)
        } else {
            format!(
                "receiver {} of {} in group {:?}",
                self.rank, self.world_size, self.group
            )
        }
    }

    pub fn kind(&self) -> CollectiveKind {
        match self.collective {
            CollectiveChoice::Cpu => CollectiveKind::Cpu,
            CollectiveChoice::Nccl => CollectiveKind::Nccl,
        }
    }

    /// Checks what can be checked before anything starts.
    pub fn validate(&self) -> Result<()> {
        if self.world_size < 2 {
            bail!("a learner group needs world size 2 or more (1 runs alone, without one)");
        }
        if self.rank >= self.world_size {
            bail!(
                "--rank {} is not below --world-size {} (ranks are 0..{})",
                self.rank,
                self.world_size,
                self.world_size - 1
            );
        }
        if self.coordinator.is_empty() {
            bail!(
                "world size {} needs the coordinator's endpoint for the rendezvous: pass \
                 --coordinator http://HOST:PORT (or TUTOR_COORDINATOR)",
                self.world_size
            );
        }
        self.auth
            .endpoint(&self.coordinator)
            .context("the --coordinator endpoint")?;
        if self.collective == CollectiveChoice::Nccl && !cfg!(feature = "nccl") {
            bail!(
                "--collective nccl: this tutor was built without NCCL; rebuild with \
                 `cargo build --features tutor-learner/nccl` (or use --collective cpu)"
            );
        }
        if self.rank == 0
            && self.collective == CollectiveChoice::Cpu
            && self.collective_advertise.is_none()
            && self.collective_listen.ip().is_unspecified()
        {
            bail!(
                "--collective-listen {} accepts connections on every interface, but the other \
                 ranks need one address to connect to: pass --collective-advertise HOST:PORT",
                self.collective_listen
            );
        }
        Ok(())
    }

    /// The key that authenticates the CPU collective's hellos in this group: derived from
    /// the run's auth token (the one `auth` sends the coordinator) and the group's name;
    /// `None` without a token (the hello is open, as on one machine over loopback).
    pub fn secret(&self) -> Option<CollectiveSecret> {
        CollectiveSecret::from_client_auth(
            &self.auth,
            &self.group,
            self.group == crate::WEIGHTS_GROUP,
        )
    }

    fn cpu_timeouts(&self) -> CpuCollectiveTimeouts {
        CpuCollectiveTimeouts {
            connect: self.rendezvous_timeout,
            io: self.collective_timeout,
        }
    }
}

async fn client(opts: &GroupOptions) -> Result<LearnerGroupClient<tutor_proto::auth::AuthChannel>> {
    let channel = opts
        .auth
        .endpoint(&opts.coordinator)?
        .connect_timeout(CALL_TIMEOUT)
        .connect()
        .await
        .with_context(|| format!("connecting to the coordinator at {}", opts.coordinator))?;
    Ok(LearnerGroupClient::new(opts.auth.channel(channel)))
}

/// Errors that calling again will not fix.
fn is_final(code: Code) -> bool {
    matches!(
        code,
        Code::Unauthenticated
            | Code::PermissionDenied
            | Code::InvalidArgument
            | Code::Unimplemented
    )
}

/// Rank 0: hands `rendezvous` to the coordinator, retrying until it answers (it may start
/// after the learner), within the rendezvous timeout. Returns the generation.
pub async fn publish(opts: &GroupOptions, rendezvous: Rendezvous) -> Result<u64> {
    let start = Instant::now();
    loop {
        let attempt = async {
            let mut c = client(opts).await?;
            let mut req = Request::new(PublishRendezvousRequest {
                rendezvous: Some(rendezvous.clone()),
            });
            req.set_timeout(CALL_TIMEOUT);
            Ok::<_, anyhow::Error>(c.publish_rendezvous(req).await)
        };
        let last = match attempt.await {
            Ok(Ok(r)) => return Ok(r.into_inner().generation),
            Ok(Err(status)) if is_final(status.code()) => bail!(
                "the coordinator at {} refused learner rank 0's rendezvous: {}",
                opts.coordinator,
                status.message()
            ),
            Ok(Err(status)) => format!("{:?}: {}", status.code(), status.message()),
            Err(e) => format!("{e:#}"),
        };
        if start.elapsed() >= opts.rendezvous_timeout {
            bail!(
                "learner rank 0 could not publish its rendezvous to the coordinator at {} \
                 within {:?} (is the coordinator running there?): {last}",
                opts.coordinator,
                opts.rendezvous_timeout
            );
        }
        tracing::debug!(error = %last, "coordinator not reachable yet for the rendezvous");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Ranks 1..K−1: waits for a rendezvous of a generation above `after` (0: any) at the
/// coordinator, within the rendezvous timeout.
pub async fn fetch(opts: &GroupOptions, after: u64) -> Result<Rendezvous> {
    let start = Instant::now();
    let mut last = String::from("no answer yet");
    loop {
        let left = opts.rendezvous_timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            bail!(
                "{}: rank 0 published no rendezvous{} at the coordinator {} \
                 within {:?}: is `tutor learner --rank 0 --world-size {} --coordinator {}` \
                 running? (last answer: {last})",
                opts.who(),
                if after > 0 {
                    format!(" newer than generation {after}")
                } else {
                    String::new()
                },
                opts.coordinator,
                opts.rendezvous_timeout,
                opts.world_size,
                opts.coordinator
            );
        }
        let wait = left.min(POLL_WAIT);
        let attempt = async {
            let mut c = client(opts).await?;
            let mut req = Request::new(GetRendezvousRequest {
                after_generation: after,
                wait_ms: wait.as_millis() as u32,
                group: opts.group.clone(),
            });
            req.set_timeout(wait + CALL_TIMEOUT);
            Ok::<_, anyhow::Error>(c.get_rendezvous(req).await)
        };
        // The call itself is bounded too (a coordinator that hangs).
        match tokio::time::timeout(wait + CALL_TIMEOUT, attempt).await {
            Ok(Ok(Ok(r))) => return Ok(r.into_inner()),
            Ok(Ok(Err(status))) if is_final(status.code()) => bail!(
                "the coordinator at {} refused learner rank {}'s rendezvous request: {}",
                opts.coordinator,
                opts.rank,
                status.message()
            ),
            Ok(Ok(Err(status))) => {
                let not_found = status.code() == Code::NotFound;
                last = format!("{:?}: {}", status.code(), status.message());
                if not_found {
                    continue; // the long poll ran out: ask again
                }
            }
            Ok(Err(e)) => last = format!("{e:#}"),
            Err(_) => last = "the coordinator did not answer in time".into(),
        }
        tokio::time::sleep(Duration::from_millis(200).min(left)).await;
    }
}

/// Rank 0: publishes a new generation of `o.group` at the coordinator and waits for the
/// other ranks to join it (CPU: within the rendezvous timeout; NCCL: until they come).
/// `what` names the group in logs. An advertised address ending in `:0` gets the port
/// the CPU collective was bound to.
pub fn form_as_rank0(
    o: &GroupOptions,
    rt: &tokio::runtime::Handle,
    what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    match o.collective {
        CollectiveChoice::Cpu => {
            let secret = o.secret();
            let authenticated = secret.is_some();
            let rdv = CpuRendezvous::bind(o.collective_listen)?.with_secret(secret);
            let bound = rdv.local_addr();
            let addr = match &o.collective_advertise {
                Some(a) => match a.strip_suffix(":0") {
                    Some(host) => format!("{host}:{}", bound.port()),
                    None => a.clone(),
                },
                None => bound.to_string(),
            };
            let generation = rt.block_on(publish(
                o,
                Rendezvous {
                    generation: 0,
                    world_size: o.world_size as u32,
                    kind: CollectiveKind::Cpu as i32,
                    cpu_address: addr.clone(),
                    nccl_unique_id: Vec::new(),
                    group: o.group.clone(),
                },
            ))?;
            tracing::info!(generation, %addr, world_size = o.world_size, authenticated, "{what} rendezvous published: waiting for the other ranks");
            let c = rdv
                .accept(o.world_size, o.cpu_timeouts())
                .with_context(|| format!("forming the {what} of generation {generation}"))?;
            Ok((Box::new(c), generation))
        }
        CollectiveChoice::Nccl => form_nccl(o, rt, what),
    }
}

#[cfg(feature = "nccl")]
fn form_nccl(
    o: &GroupOptions,
    rt: &tokio::runtime::Handle,
    what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    use crate::NcclCollective;
    let id = NcclCollective::unique_id()?;
    let generation = rt.block_on(publish(
        o,
        Rendezvous {
            generation: 0,
            world_size: o.world_size as u32,
            kind: CollectiveKind::Nccl as i32,
            cpu_address: String::new(),
            nccl_unique_id: id.to_vec(),
            group: o.group.clone(),
        },
    ))?;
    tracing::info!(
        generation,
        world_size = o.world_size,
        "{what}: NCCL unique id published: waiting for the other ranks"
    );
    let c = NcclCollective::new(&id, 0, o.world_size, o.gpu)?;
    Ok((Box::new(c), generation))
}

#[cfg(not(feature = "nccl"))]
fn form_nccl(
    _o: &GroupOptions,
    _rt: &tokio::runtime::Handle,
    _what: &str,
) -> Result<(Box<dyn Collective>, u64)> {
    bail!("this tutor was built without the `nccl` feature")
}

/// Ranks 1..K−1: joins the collective of generation `rdv`.
pub fn join_rendezvous(opts: &GroupOptions, rdv: &Rendezvous) -> Result<Box<dyn Collective>> {
    Ok(match opts.collective {
        CollectiveChoice::Cpu => Box::new(CpuCollective::connect_with_secret(
            rdv.cpu_address.as_str(),
            opts.rank,
            opts.world_size,
            opts.cpu_timeouts(),
            opts.secret().as_ref(),
        )?),
        CollectiveChoice::Nccl => nccl_join(opts, rdv)?,
    })
}

#[cfg(feature = "nccl")]
fn nccl_join(opts: &GroupOptions, rdv: &Rendezvous) -> Result<Box<dyn Collective>> {
    let id: crate::NcclUniqueId = rdv
        .nccl_unique_id
        .as_slice()
        .try_into()
        .context("the NCCL unique id must be 128 bytes")?;
    Ok(Box::new(crate::NcclCollective::new(
        &id,
        opts.rank,
        opts.world_size,
        opts.gpu,
    )?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_join(_opts: &GroupOptions, _rdv: &Rendezvous) -> Result<Box<dyn Collective>> {
    bail!("this tutor was built without the `nccl` feature")
}

#[cfg(test)]
mod tests {
    use tutor_proto::auth::{AuthToken, Role};

    use super::*;

    fn options(rank: usize, token: Option<&str>, group: &str) -> GroupOptions {
        GroupOptions {
            rank,
            world_size: 2,
            collective: CollectiveChoice::Cpu,
            coordinator: "http://127.0.0.1:1".into(),
            auth: ClientAuth::new(token.map(|t| AuthToken::new(t).unwrap()).as_ref()),
            collective_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            collective_advertise: None,
            gpu: 0,
            rendezvous_timeout: Duration::from_secs(20),
            collective_timeout: Duration::from_secs(20),
            group: group.into(),
        }
    }

    fn rendezvous(addr: SocketAddr) -> Rendezvous {
        Rendezvous {
            generation: 1,
            world_size: 2,
            kind: CollectiveKind::Cpu as i32,
            cpu_address: addr.to_string(),
            nccl_unique_id: Vec::new(),
            group: String::new(),
        }
    }

    #[test]
    fn the_group_secret_comes_from_the_run_token() {
        assert!(options(0, None, "").secret().is_none());
        let learner = options(0, Some("tok"), "").secret().unwrap();
        let learner_token = AuthToken::new("tok").unwrap().derive(Role::Learner);
        assert_eq!(
            learner,
            CollectiveSecret::from_token(learner_token.expose().as_bytes(), "")
        );
        assert_ne!(
            learner,
            options(0, Some("tok"), "weights").secret().unwrap()
        );
    }

    /// What `form_as_rank0` binds (a rendezvous with the group's secret), joined through
    /// `join_rendezvous`: with the run's token only.
    #[test]
    fn joining_a_rendezvous_proves_the_run_token() {
        let root_opts = options(0, Some("the-run-token"), "");
        let t = root_opts.cpu_timeouts();
        let rdv = CpuRendezvous::bind("127.0.0.1:0")
            .unwrap()
            .with_secret(root_opts.secret());
        let rdv_info = rendezvous(rdv.local_addr());
        let root = std::thread::spawn(move || rdv.accept(2, t));
        let err = join_rendezvous(&options(1, Some("another-token"), ""), &rdv_info)
            .err()
            .expect("joined with another token");
        assert!(format!("{err:#}").contains("auth token"), "{err:#}");
        let err = join_rendezvous(&options(1, None, ""), &rdv_info)
            .err()
            .expect("joined without a token");
        assert!(
            format!("{err:#}").contains("requires an authenticated hello"),
            "{err:#}"
        );
        let mut leaf = join_rendezvous(&options(1, Some("the-run-token"), ""), &rdv_info).unwrap();
        let mut root = root.join().unwrap().unwrap();
        let h = std::thread::spawn(move || root.barrier());
        leaf.barrier().unwrap();
        h.join().unwrap().unwrap();
    }
}
