//! The CPU collective's hello: how a rank joins rank 0's socket.
//!
//! 1. Rank 0, as soon as it accepts a connection: `MAGIC`, a mode byte (`MODE_OPEN`: no
//!    secret, `MODE_HMAC`: the hello must be authenticated) and a random 32-byte nonce.
//! 2. The joining rank: `MAGIC`, its rank and world size (u64, little-endian), its own
//!    random nonce, and HMAC-SHA256(key, `JOIN_CONTEXT`, both nonces, rank, world size)
//!    (zeros without a secret).
//! 3. Rank 0: a verdict byte (`Verdict`); when it accepts, HMAC-SHA256(key, `ROOT_CONTEXT`,
//!    both nonces, rank, world size), so the joining rank knows rank 0 holds the key too.
//!    A refused connection is closed after the verdict.
//!
//! The key ([`CollectiveSecret`]) is derived from the run's auth token and the group's
//! name; neither the token nor the key ever travels, only MACs over fresh nonces. Without
//! a token (the single-machine loopback default) there is no key and the hello is open,
//! as before. The hello only authenticates who joins: the frames after it are neither
//! encrypted nor authenticated.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use hmac::{Hmac, Mac};
use rand::rngs::OsRng;
use rand::RngCore;
use sha2::Sha256;
use tonic::service::Interceptor;
use tutor_proto::auth::{ClientAuth, AUTHORIZATION};

/// Opens every hello, both ways (version 2: the authenticated hello).
pub(crate) const MAGIC: &[u8; 8] = b"TUTORCC2";
const MODE_OPEN: u8 = 0;
const MODE_HMAC: u8 = 1;
const NONCE: usize = 32;
const MAC: usize = 32;
/// Rank 0's opening: magic, mode, nonce.
const CHALLENGE_LEN: usize = 8 + 1 + NONCE;
/// A joining rank's hello: magic, rank, world size, nonce, MAC.
const HELLO_LEN: usize = 8 + 8 + 8 + NONCE + MAC;

/// What the key is derived for (with the group's name after it).
const KEY_CONTEXT: &[u8] = b"tutor collective hello key v1\0";
/// What a joining rank's MAC says.
const JOIN_CONTEXT: &[u8] = b"tutor collective hello v1: a rank joins rank 0\0";
/// What rank 0's MAC says (a different context: a joining rank's MAC cannot be
/// reflected back as rank 0's).
const ROOT_CONTEXT: &[u8] = b"tutor collective hello v1: rank 0 accepts a rank\0";

type HmacSha256 = Hmac<Sha256>;

/// The key that authenticates the hellos of one group: HMAC-SHA256 of the group's name
/// keyed with the run's auth token. Never formatted by `Debug`, never sent.
#[derive(Clone, PartialEq, Eq)]
pub struct CollectiveSecret([u8; 32]);

impl fmt::Debug for CollectiveSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CollectiveSecret(<redacted>)")
    }
}

impl CollectiveSecret {
    /// The key of group `group` (`""`: the learner ranks, `broadcast::GROUP`: the weight
    /// receivers) of the run whose auth token is `token`.
    pub fn from_token(token: &[u8], group: &str) -> Self {
        let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes keys of any length");
        mac.update(KEY_CONTEXT);
        mac.update(group.as_bytes());
        Self(mac.finalize().into_bytes().into())
    }

    /// The key derived from the token `auth` sends to the coordinator; `None` when it
    /// sends none (no token configured: the hello stays open). The key comes from the
    /// lowest role in the group, whatever token a member holds: the learner's token for
    /// the learner ranks (a rank given the run's token derives it), and with
    /// `with_workers` (the weights broadcast, whose receivers hold the workers' token
    /// only) the workers' token.
    pub fn from_client_auth(auth: &ClientAuth, group: &str, with_workers: bool) -> Option<Self> {
        use tutor_proto::auth::{AuthToken, Role};
        // `ClientAuth` keeps its token to itself; what it adds to a call is public.
        let request = auth.clone().call(tonic::Request::new(())).ok()?;
        let value = request.metadata().get(AUTHORIZATION)?.to_str().ok()?;
        let token = AuthToken::new(value.strip_prefix("Bearer ").unwrap_or(value)).ok()?;
        let role = if with_workers {
            Role::Worker
        } else {
            Role::Learner
        };
        Some(Self::from_token(
            token.derive(role).expose().as_bytes(),
            group,
        ))
    }

    fn mac(&self, context: &[u8], nonces: [&[u8; NONCE]; 2], rank: u64, world: u64) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        mac.update(context);
        mac.update(nonces[0]);
        mac.update(nonces[1]);
        mac.update(&rank.to_le_bytes());
        mac.update(&world.to_le_bytes());
        mac
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    OsRng.fill_bytes(&mut n);
    n
}

/// Rank 0's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Verdict {
    Accepted = 0,
    BadMac = 1,
    WorldSize = 2,
    RankRange = 3,
    RankTaken = 4,
}

impl Verdict {
    fn from_byte(b: u8) -> Option<Self> {
        [
            Self::Accepted,
            Self::BadMac,
            Self::WorldSize,
            Self::RankRange,
            Self::RankTaken,
        ]
        .into_iter()
        .find(|v| *v as u8 == b)
    }
}

/// Why rank 0 refused a connection (logged with the peer's address).
#[derive(Debug)]
pub(crate) enum Refusal {
    /// No complete hello in time, not a Tutor collective, or the connection failed.
    NoHello(io::Error),
    BadMac {
        rank: u64,
        world: u64,
    },
    MacMissing {
        rank: u64,
        world: u64,
    },
    WorldSize {
        rank: u64,
        theirs: u64,
        ours: usize,
    },
    RankRange {
        rank: u64,
        world: usize,
    },
    RankTaken {
        rank: usize,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NoHello(e) => write!(f, "no valid collective hello: {e}"),
            Refusal::BadMac { rank, world } => write!(
                f,
                "its hello (rank {rank}, world size {world}) has a wrong MAC: it does not hold \
                 this run's auth token"
            ),
            Refusal::MacMissing { rank, world } => write!(
                f,
                "its hello (rank {rank}, world size {world}) is not authenticated, and this \
                 group requires it (the run has an auth token)"
            ),
            Refusal::WorldSize { rank, theirs, ours } => {
                write!(f, "rank {rank} says world size {theirs}, rank 0 has {ours}")
            }
            Refusal::RankRange { rank, world } => {
                write!(f, "it claims rank {rank}, expected 1 to {}", world - 1)
            }
            Refusal::RankTaken { rank } => write!(
                f,
                "it claims rank {rank}, which another connection already joined as"
            ),
        }
    }
}

impl Refusal {
    /// What rank 0 tells the peer before closing (`None`: nothing, the hello never came).
    fn verdict(&self) -> Option<Verdict> {
        match self {
            Refusal::NoHello(_) => None,
            Refusal::BadMac { .. } | Refusal::MacMissing { .. } => Some(Verdict::BadMac),
            Refusal::WorldSize { .. } => Some(Verdict::WorldSize),
            Refusal::RankRange { .. } => Some(Verdict::RankRange),
            Refusal::RankTaken { .. } => Some(Verdict::RankTaken),
        }
    }

    /// Tells the peer (best effort, it may be gone) and closes the connection.
    pub(crate) fn send(&self, s: &mut TcpStream, deadline: Instant) {
        if let Some(v) = self.verdict() {
            let _ = write_by(s, &[v as u8], deadline);
        }
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// A hello rank 0 read and checked, before it knows whether the rank is taken.
#[derive(Debug)]
pub(crate) struct Joining {
    pub(crate) rank: usize,
    world: u64,
    root_nonce: [u8; NONCE],
    leaf_nonce: [u8; NONCE],
}

/// Rank 0, on a freshly accepted connection: sends the challenge and reads and checks the
/// hello (MAC first, then world size and rank), all before `deadline`.
pub(crate) fn challenge(
    s: &mut TcpStream,
    secret: Option<&CollectiveSecret>,
    world_size: usize,
    deadline: Instant,
) -> Result<Joining, Refusal> {
    let root_nonce = nonce();
    let mut opening = [0u8; CHALLENGE_LEN];
    opening[..8].copy_from_slice(MAGIC);
    opening[8] = if secret.is_some() {
        MODE_HMAC
    } else {
        MODE_OPEN
    };
    opening[9..].copy_from_slice(&root_nonce);
    write_by(s, &opening, deadline).map_err(Refusal::NoHello)?;
    let mut magic = [0u8; 8];
    read_by(s, &mut magic, deadline).map_err(Refusal::NoHello)?;
    if &magic != MAGIC {
        return Err(Refusal::NoHello(io::Error::new(
            io::ErrorKind::InvalidData,
            "it does not speak this version of the Tutor CPU collective (bad magic)",
        )));
    }
    let mut rest = [0u8; HELLO_LEN - 8];
    read_by(s, &mut rest, deadline).map_err(Refusal::NoHello)?;
    let rank = u64::from_le_bytes(rest[0..8].try_into().unwrap());
    let world = u64::from_le_bytes(rest[8..16].try_into().unwrap());
    let leaf_nonce: [u8; NONCE] = rest[16..16 + NONCE].try_into().unwrap();
    let mac = &rest[16 + NONCE..];
    if let Some(key) = secret {
        if mac.iter().all(|&b| b == 0) {
            return Err(Refusal::MacMissing { rank, world });
        }
        // `verify_slice` compares in constant time.
        key.mac(JOIN_CONTEXT, [&root_nonce, &leaf_nonce], rank, world)
            .verify_slice(mac)
            .map_err(|_| Refusal::BadMac { rank, world })?;
    }
    if world != world_size as u64 {
        return Err(Refusal::WorldSize {
            rank,
            theirs: world,
            ours: world_size,
        });
    }
    if rank == 0 || rank >= world_size as u64 {
        return Err(Refusal::RankRange {
            rank,
            world: world_size,
        });
    }
    Ok(Joining {
        rank: rank as usize,
        world,
        root_nonce,
        leaf_nonce,
    })
}

/// Rank 0: tells a checked rank it is in, with rank 0's own MAC.
pub(crate) fn admit(
    s: &mut TcpStream,
    joining: &Joining,
    secret: Option<&CollectiveSecret>,
    deadline: Instant,
) -> io::Result<()> {
    let mut answer = [0u8; 1 + MAC];
    answer[0] = Verdict::Accepted as u8;
    if let Some(key) = secret {
        let mac = key.mac(
            ROOT_CONTEXT,
            [&joining.root_nonce, &joining.leaf_nonce],
            joining.rank as u64,
            joining.world,
        );
        answer[1..].copy_from_slice(&mac.finalize().into_bytes());
    }
    write_by(s, &answer, deadline)
}

/// Why a joining rank's hello failed.
#[derive(Debug)]
pub(crate) enum JoinError {
    /// The connection failed or timed out: trying again may help.
    Io(io::Error),
    /// Rank 0 refused this rank, or this rank refused rank 0: trying again will not help.
    Refused(String),
}

impl From<io::Error> for JoinError {
    fn from(e: io::Error) -> Self {
        JoinError::Io(e)
    }
}

/// A joining rank: answers rank 0's challenge on `s` and waits for its verdict, before
/// `deadline`.
pub(crate) fn join(
    s: &mut TcpStream,
    rank: usize,
    world_size: usize,
    secret: Option<&CollectiveSecret>,
    deadline: Instant,
) -> Result<(), JoinError> {
    let mut opening = [0u8; CHALLENGE_LEN];
    read_by(s, &mut opening, deadline)?;
    if &opening[..8] != MAGIC {
        return Err(JoinError::Io(io::Error::new(
            io::ErrorKind::InvalidData,
            "the listener is not a Tutor CPU collective of this version",
        )));
    }
    match (opening[8], secret) {
        (MODE_OPEN, None) | (MODE_HMAC, Some(_)) => {}
        (MODE_OPEN, Some(_)) => {
            return Err(JoinError::Refused(
                "rank 0 runs without an auth token, this rank has one: not joining a group \
                 that does not authenticate its ranks (give every process the same token)"
                    .into(),
            ))
        }
        (MODE_HMAC, None) => {
            return Err(JoinError::Refused(
                "rank 0 requires an authenticated hello and this rank has no auth token \
                 (pass the run's --auth-token-file or TUTOR_AUTH_TOKEN)"
                    .into(),
            ))
        }
        (mode, _) => {
            return Err(JoinError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("rank 0 asks for an unknown hello mode {mode}"),
            )))
        }
    }
    let root_nonce: [u8; NONCE] = opening[9..].try_into().unwrap();
    let leaf_nonce = nonce();
    let (rank, world) = (rank as u64, world_size as u64);
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..16].copy_from_slice(&rank.to_le_bytes());
    hello[16..24].copy_from_slice(&world.to_le_bytes());
    hello[24..24 + NONCE].copy_from_slice(&leaf_nonce);
    if let Some(key) = secret {
        let mac = key.mac(JOIN_CONTEXT, [&root_nonce, &leaf_nonce], rank, world);
        hello[24 + NONCE..].copy_from_slice(&mac.finalize().into_bytes());
    }
    write_by(s, &hello, deadline)?;
    let mut verdict = [0u8; 1];
    read_by(s, &mut verdict, deadline).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => JoinError::Io(io::Error::new(
            e.kind(),
            "rank 0 closed the connection after this rank's hello",
        )),
        _ => JoinError::Io(e),
    })?;
    match Verdict::from_byte(verdict[0]) {
        Some(Verdict::Accepted) => {}
        Some(Verdict::BadMac) => {
            return Err(JoinError::Refused(
                "this rank's hello did not authenticate: rank 0 has a different auth token \
                 (every process of a run needs the same --auth-token-file or TUTOR_AUTH_TOKEN)"
                    .into(),
            ))
        }
        Some(Verdict::WorldSize) => {
            return Err(JoinError::Refused(format!(
                "rank 0 has a world size other than this rank's {world_size} (start every \
                 rank with the same --world-size)"
            )))
        }
        Some(Verdict::RankRange) => {
            return Err(JoinError::Refused(format!(
                "rank 0 does not expect rank {rank} in a world of {world_size}"
            )))
        }
        Some(Verdict::RankTaken) => {
            return Err(JoinError::Refused(format!(
                "another process already joined as rank {rank} (two ranks with the same --rank?)"
            )))
        }
        None => {
            return Err(JoinError::Io(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "rank 0 answered the hello with an unknown verdict {}",
                    verdict[0]
                ),
            )))
        }
    }
    let mut mac = [0u8; MAC];
    read_by(s, &mut mac, deadline)?;
    if let Some(key) = secret {
        key.mac(ROOT_CONTEXT, [&root_nonce, &leaf_nonce], rank, world)
            .verify_slice(&mac)
            .map_err(|_| {
                JoinError::Refused(
                    "rank 0's answer did not authenticate: whoever listens at its address does \
                     not hold this run's auth token"
                        .into(),
                )
            })?;
    }
    Ok(())
}

/// `read_exact` that gives up at `deadline` however slowly the bytes trickle in.
pub(crate) fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut off = 0;
    while off < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("timed out after {off} of {} hello bytes", buf.len()),
            ));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[off..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "the connection closed after {off} of {} hello bytes",
                        buf.len()
                    ),
                ))
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "hello deadline passed",
        ));
    }
    s.set_write_timeout(Some(left))?;
    s.write_all(buf)?;
    s.flush()
}

#[cfg(test)]
pub(crate) mod testing {
    //! Hand-made hellos for the tests: what a stray or hostile peer could send.
    use super::*;

    /// Reads rank 0's challenge; returns its mode byte and nonce.
    pub(crate) fn read_challenge(s: &mut TcpStream, deadline: Instant) -> (u8, [u8; NONCE]) {
        let mut opening = [0u8; CHALLENGE_LEN];
        read_by(s, &mut opening, deadline).unwrap();
        assert_eq!(&opening[..8], MAGIC);
        (opening[8], opening[9..].try_into().unwrap())
    }

    /// A hello with `rank` and `world`, MAC'd with `secret` (zeros without one).
    pub(crate) fn hello(
        root_nonce: &[u8; NONCE],
        rank: u64,
        world: u64,
        secret: Option<&CollectiveSecret>,
    ) -> Vec<u8> {
        let leaf_nonce = nonce();
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&rank.to_le_bytes());
        out.extend_from_slice(&world.to_le_bytes());
        out.extend_from_slice(&leaf_nonce);
        match secret {
            Some(key) => out.extend_from_slice(
                &key.mac(JOIN_CONTEXT, [root_nonce, &leaf_nonce], rank, world)
                    .finalize()
                    .into_bytes(),
            ),
            None => out.extend_from_slice(&[0u8; MAC]),
        }
        out
    }

    /// Rank 0's verdict on a hand-made hello: `None` when it closed without one.
    pub(crate) fn verdict(s: &mut TcpStream, deadline: Instant) -> Option<Verdict> {
        let mut b = [0u8; 1];
        read_by(s, &mut b, deadline).ok()?;
        Verdict::from_byte(b[0])
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Duration;

    use tutor_proto::auth::AuthToken;

    use super::*;

    const TOKEN: &str = "s3cret-run-token-0123456789abcdef";

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(20)
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn the_key_comes_from_the_token_the_client_sends_and_the_group() {
        let token = AuthToken::new(TOKEN).unwrap();
        let auth = ClientAuth::new(Some(&token));
        let key = CollectiveSecret::from_client_auth(&auth, "", false).unwrap();
        // The learner ranks' key comes from the learner's token: a rank given the run's
        // token and one given the learner's get the same key.
        let learner = token.derive(tutor_proto::auth::Role::Learner);
        assert_eq!(
            key,
            CollectiveSecret::from_token(learner.expose().as_bytes(), "")
        );
        assert_eq!(
            key,
            CollectiveSecret::from_client_auth(&ClientAuth::new(Some(&learner)), "", false)
                .unwrap()
        );
        assert_ne!(
            key,
            CollectiveSecret::from_client_auth(&auth, "weights", false).unwrap(),
            "each group has its own key"
        );
        // The weights group has workers in it, who hold the workers' token: the learner
        // (run token or learner token) and a worker (worker token) get the same key.
        let worker = token.derive(tutor_proto::auth::Role::Worker);
        for holder in [&token, &learner] {
            assert_eq!(
                CollectiveSecret::from_client_auth(&ClientAuth::new(Some(holder)), "weights", true)
                    .unwrap(),
                CollectiveSecret::from_client_auth(
                    &ClientAuth::new(Some(&worker)),
                    "weights",
                    true
                )
                .unwrap(),
            );
        }
        assert_ne!(key, CollectiveSecret::from_token(b"another-token", ""));
        assert!(CollectiveSecret::from_client_auth(&ClientAuth::new(None), "", false).is_none());
        assert_eq!(format!("{key:?}"), "CollectiveSecret(<redacted>)");
    }

    /// Rank 0 and a joining rank over a real socket, each side's bytes recorded by a
    /// relay: neither the token nor the key derived from it is ever among them.
    #[test]
    fn neither_the_token_nor_the_key_travels() {
        let key = CollectiveSecret::from_token(TOKEN.as_bytes(), "");
        let root = TcpListener::bind("127.0.0.1:0").unwrap();
        let relay = TcpListener::bind("127.0.0.1:0").unwrap();
        let (root_addr, relay_addr) = (root.local_addr().unwrap(), relay.local_addr().unwrap());
        let root_key = key.clone();
        let rank0 = std::thread::spawn(move || {
            let (mut s, _) = root.accept().unwrap();
            let j = challenge(&mut s, Some(&root_key), 2, soon()).unwrap();
            admit(&mut s, &j, Some(&root_key), soon()).unwrap();
            j.rank
        });
        // The relay copies bytes both ways and keeps them.
        let recorder = std::thread::spawn(move || {
            let (leaf, _) = relay.accept().unwrap();
            let up = TcpStream::connect(root_addr).unwrap();
            let pipe = |mut from: TcpStream, mut to: TcpStream| {
                std::thread::spawn(move || {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 256];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        seen.extend_from_slice(&buf[..n]);
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                    seen
                })
            };
            let a = pipe(leaf.try_clone().unwrap(), up.try_clone().unwrap());
            let b = pipe(up, leaf);
            let mut all = a.join().unwrap();
            all.extend(b.join().unwrap());
            all
        });
        let mut s = TcpStream::connect(relay_addr).unwrap();
        join(&mut s, 1, 2, Some(&key), soon()).unwrap();
        assert_eq!(rank0.join().unwrap(), 1);
        drop(s);
        let seen = recorder.join().unwrap();
        assert_eq!(
            seen.len(),
            CHALLENGE_LEN + HELLO_LEN + 1 + MAC,
            "the whole hello was relayed"
        );
        assert!(
            !contains(&seen, TOKEN.as_bytes()),
            "the token went over the wire"
        );
        assert!(!contains(&seen, &key.0[..16]), "the key went over the wire");
    }

    /// Someone else listening at rank 0's address (without the key) cannot pass for it.
    #[test]
    fn a_joining_rank_refuses_a_rank_0_without_the_key() {
        let key = CollectiveSecret::from_token(TOKEN.as_bytes(), "");
        let fake = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = fake.accept().unwrap();
            let mut opening = [0u8; CHALLENGE_LEN];
            opening[..8].copy_from_slice(MAGIC);
            opening[8] = MODE_HMAC;
            s.write_all(&opening).unwrap();
            let mut hello = [0u8; HELLO_LEN];
            s.read_exact(&mut hello).unwrap();
            // "Accepted", with a MAC it cannot compute.
            s.write_all(&[0u8; 1 + MAC]).unwrap();
            std::thread::sleep(Duration::from_secs(1));
        });
        let mut s = TcpStream::connect(addr).unwrap();
        match join(&mut s, 1, 2, Some(&key), soon()) {
            Err(JoinError::Refused(why)) => assert!(why.contains("did not authenticate"), "{why}"),
            other => panic!("joined a rank 0 without the key: {other:?}"),
        }
    }
}
