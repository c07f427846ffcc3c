//! The shared bearer token of a Tutor deployment: loading it, checking it on every
//! server (`ServerAuth`) and sending it from every client (`ClientAuth`).
//!
//! The token is a secret: it is never formatted by `Debug`, never put in a `Status`
//! message and never logged; only file paths and counts are.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataMap, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::tls::{ClientTls, TlsError};

/// Environment variable holding the token itself (`--auth-token-file` wins over it).
pub const AUTH_TOKEN_ENV: &str = "TUTOR_AUTH_TOKEN";

/// The gRPC metadata key that carries `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

/// What a token may do. The run's token is the operator's: every call. A role's token is
/// derived from it ([`AuthToken::derive`]) and allowed only the services that role needs:
/// a stolen learner token cannot shut the run down or lease episodes, a stolen worker
/// token cannot do that either, nor train and publish weights.
///
/// The roles form a chain, operator → learner → worker: the learner's token is derived
/// from the run's, the workers' from the learner's. Whoever holds a token can derive (and
/// so check) the tokens below it, and cannot get back to those above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The run's own token: the coordinator, `tutor run`, the operator's tools.
    Operator,
    /// The learner ranks: the learner's services (training, publishing, weights), the
    /// coordinator's rendezvous.
    Learner,
    /// A rollout worker: the Rollout service, the rendezvous of the weights broadcast,
    /// the weights.
    Worker,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Operator => "operator",
            Role::Learner => "learner",
            Role::Worker => "worker",
        }
    }

    /// The prefix of this role's tokens; the rest is the HMAC that proves them.
    fn prefix(self) -> &'static str {
        match self {
            Role::Operator => "",
            Role::Learner => "learner.",
            Role::Worker => "worker.",
        }
    }

    /// Position in the chain: a token derives the tokens of higher ranks.
    fn rank(self) -> u8 {
        match self {
            Role::Operator => 0,
            Role::Learner => 1,
            Role::Worker => 2,
        }
    }
}

/// A shared secret every process of one deployment holds: the run's (operator) token,
/// or a role's token derived from it.
#[derive(Clone)]
pub struct AuthToken(Arc<str>);

impl fmt::Debug for AuthToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthToken(<redacted>)")
    }
}

/// Why no token could be loaded. Messages name the source, never the secret.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("reading the auth token file {path}: {source}")]
    ReadFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the auth token file {path} is empty: write the shared token into it")]
    EmptyFile { path: PathBuf },
    #[error(
        "the auth token file {path} holds characters a gRPC header cannot carry: \
         use printable ASCII without spaces (e.g. 64 hex digits)"
    )]
    InvalidFile { path: PathBuf },
    #[error("{AUTH_TOKEN_ENV} is set but empty: unset it or give it the shared token")]
    EmptyEnv,
    #[error(
        "{AUTH_TOKEN_ENV} holds characters a gRPC header cannot carry: \
         use printable ASCII without spaces (e.g. 64 hex digits)"
    )]
    InvalidEnv,
}

impl AuthToken {
    /// Surrounding whitespace (a trailing newline in a file) is not part of the token.
    /// `None` if what is left is empty or cannot travel in a header.
    fn parse(raw: &str) -> Result<Self, bool> {
        let t = raw.trim();
        if t.is_empty() {
            return Err(true);
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(false);
        }
        Ok(Self(t.into()))
    }

    /// A token from a string: the value of `TUTOR_AUTH_TOKEN`, or one `tutor run` generated.
    pub fn new(raw: &str) -> Result<Self, AuthError> {
        Self::parse(raw).map_err(|empty| {
            if empty {
                AuthError::EmptyEnv
            } else {
                AuthError::InvalidEnv
            }
        })
    }

    /// The secret itself, for writing it into a token file. Do not log it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The role this token is for: a derived role token says so in its prefix.
    pub fn role(&self) -> Role {
        [Role::Learner, Role::Worker]
            .into_iter()
            .find(|r| self.0.starts_with(r.prefix()))
            .unwrap_or(Role::Operator)
    }

    /// The token of `role` derived from this one, down the chain operator → learner →
    /// worker: the learner's is `learner.<hex HMAC-SHA256(run token, "tutor role token v1:
    /// learner")>`, the workers' `worker.<hex HMAC-SHA256(learner token, "tutor role token
    /// v1: worker")>`. So the run token and the learner token give the same worker token.
    /// A token of `role` itself, or of a role below it (which cannot get back up the
    /// chain), is given back unchanged.
    pub fn derive(&self, role: Role) -> AuthToken {
        let mut token = self.clone();
        while token.role().rank() < role.rank() {
            let next = match token.role() {
                Role::Operator => Role::Learner,
                _ => Role::Worker,
            };
            use hmac::Mac;
            let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(token.0.as_bytes())
                .expect("HMAC takes a key of any length");
            mac.update(b"tutor role token v1: ");
            mac.update(next.as_str().as_bytes());
            let tag = hex::encode(mac.finalize().into_bytes());
            token = AuthToken(format!("{}{tag}", next.prefix()).into());
        }
        token
    }
}

/// The token of this process: read from `file` when given, else from `TUTOR_AUTH_TOKEN`;
/// `None` when neither is set.
pub fn load_token(file: Option<&Path>) -> Result<Option<AuthToken>, AuthError> {
    let env = std::env::var_os(AUTH_TOKEN_ENV).map(|v| v.to_string_lossy().into_owned());
    load_token_from(file, env.as_deref())
}

/// `load_token` with the environment value passed in (testable without touching the
/// process environment).
pub fn load_token_from(
    file: Option<&Path>,
    env_value: Option<&str>,
) -> Result<Option<AuthToken>, AuthError> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|source| AuthError::ReadFile {
            path: path.to_path_buf(),
            source,
        })?;
        warn_if_readable_by_others(path);
        return AuthToken::parse(&text).map(Some).map_err(|empty| {
            let path = path.to_path_buf();
            if empty {
                AuthError::EmptyFile { path }
            } else {
                AuthError::InvalidFile { path }
            }
        });
    }
    match env_value {
        Some(v) => AuthToken::new(v).map(Some),
        None => Ok(None),
    }
}

#[cfg(unix)]
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", mode & 0o777),
                "the auth token file is readable by other users: chmod 600 it"
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_readable_by_others(_path: &Path) {}

/// Server side: rejects calls without `authorization: Bearer <token>` (constant-time
/// comparison) and counts them. Without a token it lets every call through, for
/// single-role development; the server warns about that at start.
#[derive(Clone)]
pub struct ServerAuth {
    token: Option<AuthToken>,
    /// The tokens of the roles below `token`'s (derived from it), each checked when its
    /// role is allowed.
    below: Vec<(Role, AuthToken)>,
    /// Roles besides the token's own this service takes calls from.
    allowed: &'static [Role],
    rejected: Arc<AtomicU64>,
}

impl fmt::Debug for ServerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerAuth")
            .field("enabled", &self.is_enabled())
            .field("rejected", &self.rejected_count())
            .finish()
    }
}

impl ServerAuth {
    /// A server holding `token` (the run's, or a role's: a learner serves with the
    /// learner token): the tokens of the roles below it are derived from it and checked
    /// against it. Until [`Self::allowing`] narrows it, it takes every role it can check.
    pub fn new(token: Option<AuthToken>) -> Self {
        let below = token
            .as_ref()
            .map(|t| {
                [Role::Learner, Role::Worker]
                    .into_iter()
                    .filter(|r| r.rank() > t.role().rank())
                    .map(|r| (r, t.derive(r)))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            token,
            below,
            allowed: &[Role::Learner, Role::Worker],
            rejected: Default::default(),
        }
    }

    /// The same check (and rejection count) for a service that takes calls from the
    /// server's own token and `roles` only; another role's valid token gets
    /// PERMISSION_DENIED.
    pub fn allowing(&self, roles: &'static [Role]) -> Self {
        Self {
            allowed: roles,
            ..self.clone()
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.token.is_some()
    }

    /// Whose tokens this service takes, for PERMISSION_DENIED messages.
    fn takes(&self) -> String {
        let own = self.token.as_ref().map_or(Role::Operator, |t| t.role());
        let mut names = vec![match own {
            Role::Operator => "the run's (operator) token".to_string(),
            r => format!("the {} token", r.as_str()),
        }];
        names.extend(
            self.below
                .iter()
                .filter(|(r, _)| self.allowed.contains(r))
                .map(|(r, _)| format!("the {} token", r.as_str())),
        );
        names.join(" and ")
    }

    /// Calls rejected so far (for metrics).
    pub fn rejected_count(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Wraps a generated server so that every one of its calls is checked. Leave the
    /// health service unwrapped: probes carry no secrets.
    pub fn intercept<S>(&self, service: S) -> InterceptedService<S, ServerAuth> {
        InterceptedService::new(service, self.clone())
    }

    /// Checks the call's metadata; the error never echoes what the caller sent.
    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        self.caller(metadata).map(drop)
    }

    /// [`Self::check`], and the role of the token the call carried: the server's own
    /// token's, or the role below it that it matched; `None` without auth.
    pub fn caller(&self, metadata: &MetadataMap) -> Result<Option<Role>, Status> {
        let Some(token) = &self.token else {
            return Ok(None);
        };
        let verdict = match metadata.get(AUTHORIZATION) {
            None => Err("missing authorization metadata: send `authorization: Bearer <token>`"),
            Some(value) => match bearer(value.as_bytes()) {
                None => Err("the authorization metadata is not `Bearer <token>`"),
                Some(sent) if bool::from(sent.ct_eq(token.expose().as_bytes())) => Ok(token.role()),
                Some(sent) => match self
                    .below
                    .iter()
                    .find(|(_, t)| bool::from(sent.ct_eq(t.expose().as_bytes())))
                {
                    Some((role, _)) if self.allowed.contains(role) => Ok(*role),
                    Some((role, _)) => {
                        return Err(Status::permission_denied(format!(
                            "a {} token may not call this service: it takes {}",
                            role.as_str(),
                            self.takes()
                        )));
                    }
                    None => Err("wrong bearer token"),
                },
            },
        };
        verdict.map(Some).map_err(|why| {
            let n = self.rejected.fetch_add(1, Ordering::Relaxed) + 1;
            // Logarithmic: a misconfigured client or a scanner cannot flood the log.
            if n.is_power_of_two() {
                tracing::warn!(
                    rejected_total = n,
                    reason = why,
                    "rejected an unauthenticated gRPC call"
                );
            }
            Status::unauthenticated(format!(
                "{why}; every Tutor process needs the same --auth-token-file or {AUTH_TOKEN_ENV}"
            ))
        })
    }
}

/// The credentials of `Bearer <credentials>` (the scheme is case-insensitive).
fn bearer(value: &[u8]) -> Option<&[u8]> {
    let (scheme, rest) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let creds = rest.trim_ascii();
    (!creds.is_empty()).then_some(creds)
}

/// The role of the token a call carried (in the request's extensions, put there by
/// [`ServerAuth`]'s interceptor; absent without auth), for handlers that allow a role
/// less than their service does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerRole(pub Role);

impl Interceptor for ServerAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(role) = self.caller(request.metadata())? {
            request.extensions_mut().insert(CallerRole(role));
        }
        Ok(request)
    }
}

/// Client side: adds `authorization: Bearer <token>` to every call (nothing without a
/// token), and holds the client's TLS settings (certificate and CA, see `tls`) for the
/// endpoints it connects to. The header value is marked sensitive, so `Debug` of a
/// request hides it.
#[derive(Clone, Default)]
pub struct ClientAuth {
    header: Option<MetadataValue<Ascii>>,
    tls: Option<ClientTls>,
}

impl fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientAuth")
            .field("token", &self.header.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls)
            .finish()
    }
}

/// A channel whose calls carry the token; what every Tutor client is built on.
pub type AuthChannel = InterceptedService<Channel, ClientAuth>;

impl ClientAuth {
    pub fn new(token: Option<&AuthToken>) -> Self {
        let header = token.map(|t| {
            let mut v: MetadataValue<Ascii> = format!("Bearer {}", t.expose())
                .parse()
                .expect("a parsed token is printable ASCII, a valid header value");
            v.set_sensitive(true);
            v
        });
        Self { header, tls: None }
    }

    /// The same, connecting over TLS (`https://` endpoints) when `tls` is given.
    pub fn with_tls(self, tls: Option<ClientTls>) -> Self {
        Self { tls, ..self }
    }

    pub fn tls(&self) -> Option<&ClientTls> {
        self.tls.as_ref()
    }

    /// An endpoint for `url` with this client's TLS settings; `https://` is required
    /// with TLS and refused without (see `tls::endpoint`).
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, TlsError> {
        crate::tls::endpoint(url, self.tls.as_ref())
    }

    /// `channel` with the token added to every call.
    pub fn channel(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, self.clone())
    }
}

impl Interceptor for ClientAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            request.metadata_mut().insert(AUTHORIZATION, h.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(s: &str) -> AuthToken {
        AuthToken::new(s).unwrap()
    }

    fn request_with(value: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(v) = value {
            r.metadata_mut()
                .insert(AUTHORIZATION, v.parse().expect("ascii"));
        }
        r
    }

    #[test]
    fn file_wins_over_env_and_is_trimmed() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("token");
        std::fs::write(&f, "from-file\n").unwrap();
        let t = load_token_from(Some(&f), Some("from-env"))
            .unwrap()
            .unwrap();
        assert_eq!(t.expose(), "from-file");
        let t = load_token_from(None, Some(" from-env ")).unwrap().unwrap();
        assert_eq!(t.expose(), "from-env");
        assert!(load_token_from(None, None).unwrap().is_none());
    }

    #[test]
    fn file_errors_name_the_file_and_never_the_token() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("no-such-token");
        let e = load_token_from(Some(&missing), Some("s3cret")).unwrap_err();
        assert!(e.to_string().contains("no-such-token"), "{e}");

        let empty = d.path().join("empty-token");
        std::fs::write(&empty, "\n  \n").unwrap();
        let e = load_token_from(Some(&empty), None).unwrap_err();
        assert!(
            matches!(e, AuthError::EmptyFile { .. }) && e.to_string().contains("empty-token"),
            "{e}"
        );

        let bad = d.path().join("bad-token");
        std::fs::write(&bad, "two words-s3cret").unwrap();
        let e = load_token_from(Some(&bad), None).unwrap_err();
        assert!(e.to_string().contains("bad-token"), "{e}");
        assert!(!e.to_string().contains("s3cret"), "{e}");

        assert!(matches!(
            load_token_from(None, Some("")),
            Err(AuthError::EmptyEnv)
        ));
        let e = load_token_from(None, Some("s3cret\u{e9}")).unwrap_err();
        assert!(!e.to_string().contains("s3cret"), "{e}");
    }

    #[test]
    fn debug_output_hides_the_token() {
        let t = token("s3cret-token");
        let client = ClientAuth::new(Some(&t));
        let server = ServerAuth::new(Some(t.clone()));
        let mut c = client.clone();
        let req = c.call(Request::new(())).unwrap();
        for text in [
            format!("{t:?}"),
            format!("{client:?}"),
            format!("{server:?}"),
            format!("{req:?}"),
        ] {
            assert!(!text.contains("s3cret"), "{text}");
        }
    }

    #[test]
    fn interceptor_accepts_only_the_right_bearer_token_and_counts_rejections() {
        let mut server = ServerAuth::new(Some(token("s3cret-token")));
        assert!(server
            .call(request_with(Some("Bearer s3cret-token")))
            .is_ok());
        assert!(server
            .call(request_with(Some("bearer s3cret-token")))
            .is_ok());
        assert_eq!(server.rejected_count(), 0);

        let cases = [
            None,
            Some("Bearer wrong-token"),
            Some("Bearer s3cret-token-longer"),
            Some("Bearer s3cret-toke"),
            Some("s3cret-token"),
            Some("Basic s3cret-token"),
            Some("Bearer "),
        ];
        for (i, case) in cases.iter().enumerate() {
            let status = server.call(request_with(*case)).unwrap_err();
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{case:?}");
            assert!(!status.message().contains("s3cret"), "{status:?}");
            assert_eq!(server.rejected_count(), i as u64 + 1);
        }
    }

    #[test]
    fn client_interceptor_sends_what_the_server_expects() {
        let t = token("abc123");
        let mut client = ClientAuth::new(Some(&t));
        let mut server = ServerAuth::new(Some(t));
        let req = client.call(Request::new(())).unwrap();
        assert!(server.call(req).is_ok());

        // Without a token the client sends nothing, which an authenticating server refuses.
        let mut anonymous = ClientAuth::new(None);
        let req = anonymous.call(Request::new(())).unwrap();
        assert!(req.metadata().get(AUTHORIZATION).is_none());
        assert!(server.call(req).is_err());
    }

    #[test]
    fn without_a_token_the_server_lets_calls_through() {
        let mut open = ServerAuth::new(None);
        assert!(!open.is_enabled());
        assert!(open.call(request_with(None)).is_ok());
        assert!(open.call(request_with(Some("Bearer anything"))).is_ok());
        assert_eq!(open.rejected_count(), 0);
    }

    /// The worker token is derived from the run's token (and only from it), says its
    /// role, and is accepted by a service that allows workers while one that takes the
    /// operator only answers PERMISSION_DENIED; the run's token is accepted by both.
    #[test]
    fn role_tokens_are_derived_checked_and_scoped() {
        let run = token("run-s3cret");
        let worker = run.derive(Role::Worker);
        assert_eq!(run.role(), Role::Operator);
        assert_eq!(worker.role(), Role::Worker);
        assert!(worker.expose().starts_with("worker.") && worker.expose().len() == 71);
        assert_eq!(worker.derive(Role::Worker).expose(), worker.expose());
        assert_ne!(
            token("another-run").derive(Role::Worker).expose(),
            worker.expose()
        );
        assert!(!worker.expose().contains("s3cret"));

        let server = ServerAuth::new(Some(run.clone()));
        let mut workers_too = server.allowing(&[Role::Worker]);
        let mut operator_only = server.allowing(&[]);
        let bearer = |t: &AuthToken| request_with(Some(&format!("Bearer {}", t.expose())));
        assert!(workers_too.call(bearer(&worker)).is_ok());
        assert!(workers_too.call(bearer(&run)).is_ok());
        assert!(operator_only.call(bearer(&run)).is_ok());
        let denied = operator_only.call(bearer(&worker)).unwrap_err();
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        let forged = token(&format!("worker.{}", "ab".repeat(32)));
        let status = workers_too.call(bearer(&forged)).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        // The services share one rejection count.
        assert_eq!(server.rejected_count(), 1);
    }

    /// The learner's token sits between the run's and the workers': derived from the run
    /// token, it derives the same worker token the run token does, so a learner serving
    /// with it checks the workers' calls and the coordinator's (which sends it), and a
    /// server holding the run token takes it only where learners are allowed.
    #[test]
    fn the_learner_token_sits_between_the_run_and_the_workers() {
        let run = token("run-s3cret");
        let learner = run.derive(Role::Learner);
        let worker = run.derive(Role::Worker);
        assert_eq!(learner.role(), Role::Learner);
        assert!(learner.expose().starts_with("learner.") && learner.expose().len() == 72);
        assert_eq!(learner.derive(Role::Worker).expose(), worker.expose());
        // Nobody gets back up the chain.
        assert_eq!(learner.derive(Role::Operator).expose(), learner.expose());
        assert_eq!(worker.derive(Role::Learner).expose(), worker.expose());
        assert_ne!(learner.expose(), worker.expose());
        assert!(!learner.expose().contains("s3cret"));

        let bearer = |t: &AuthToken| request_with(Some(&format!("Bearer {}", t.expose())));
        // The coordinator holds the run token: its rendezvous takes learners and
        // workers, Rollout workers only, Control the operator only.
        let coordinator = ServerAuth::new(Some(run.clone()));
        let mut rendezvous = coordinator.allowing(&[Role::Learner, Role::Worker]);
        let mut rollout = coordinator.allowing(&[Role::Worker]);
        let mut control = coordinator.allowing(&[]);
        assert!(rendezvous.call(bearer(&learner)).is_ok());
        assert!(rendezvous.call(bearer(&worker)).is_ok());
        for denied in [
            rollout.call(bearer(&learner)),
            control.call(bearer(&learner)),
        ] {
            let status = denied.unwrap_err();
            assert_eq!(status.code(), tonic::Code::PermissionDenied, "{status:?}");
            assert!(status.message().contains("learner token"), "{status:?}");
        }
        let status = control.call(bearer(&worker)).unwrap_err();
        assert!(
            status.message().contains("operator") && !status.message().contains("s3cret"),
            "{status:?}"
        );

        // A learner serving with its own token: training takes that token (what the
        // coordinator sends), the weights the workers' too; the run token, which it
        // cannot check, is no token to it.
        let served = ServerAuth::new(Some(learner.clone()));
        let mut training = served.allowing(&[Role::Learner]);
        let mut weights = served.allowing(&[Role::Learner, Role::Worker]);
        assert!(training.call(bearer(&learner)).is_ok());
        assert_eq!(
            training.call(bearer(&worker)).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(weights.call(bearer(&worker)).is_ok());
        assert_eq!(
            training.call(bearer(&run)).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        // A made-up learner token is no token either.
        let forged = token(&format!("learner.{}", "ab".repeat(32)));
        assert_eq!(
            rendezvous.call(bearer(&forged)).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }
}
