//! TLS for every gRPC server and client of a deployment, with client certificates
//! (mutual TLS) when a CA is given. rustls with the `ring` provider (no aws-lc C build).
//!
//! One set of three PEM files per process (`--tls-cert`, `--tls-key`, `--tls-ca`):
//! - a server presents `cert`/`key`; with `ca` it requires every client to present a
//!   certificate signed by that CA (mutual TLS), without it any client may connect;
//! - a client verifies the server against `ca` (required) and presents `cert`/`key`
//!   when given;
//! - the coordinator is both: it serves workers and calls the learner with the same
//!   files, so its certificate must allow both uses (no extended key usage, or both
//!   `serverAuth` and `clientAuth`).
//!
//! A server certificate must name the host clients dial (a DNS name or an IP address in
//! its subject alternative names): `https://127.0.0.1:7301` needs IP 127.0.0.1.
//! The shared token (`auth`) works as before on top of TLS.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// Why TLS could not be set up. Messages name the file or the flag, never key material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading the TLS {what} file {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the TLS {what} file {path} is not valid PEM: {detail}")]
    BadPem {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error("{0}")]
    Flags(&'static str),
    #[error("TLS with certificate {cert} and key {key}: {detail}")]
    Server {
        cert: PathBuf,
        key: PathBuf,
        detail: String,
    },
    #[error("TLS to {endpoint}: {detail}")]
    Endpoint { endpoint: String, detail: String },
}

/// The three PEM files of one process, as given on the command line or in `[tls]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// This process's certificate chain (PEM), leaf first.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
    /// The CA (PEM, one or more certificates) that signs the peers' certificates.
    pub ca: Option<PathBuf>,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a PEM file of certificates, refusing one with none or a broken one.
fn read_certs(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read(what, path)?;
    let bad = |detail: String| TlsError::BadPem {
        what,
        path: path.to_path_buf(),
        detail,
    };
    let mut n = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| bad(format!("{e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(bad("no `BEGIN CERTIFICATE` block".into()));
    }
    Ok(pem)
}

fn read_key(path: &Path) -> Result<Vec<u8>, TlsError> {
    let pem = read("key", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::BadPem {
        what: "key",
        path: path.to_path_buf(),
        detail: match e {
            rustls_pki_types::pem::Error::NoItemsFound => {
                "no `BEGIN PRIVATE KEY` (PKCS#8), `BEGIN RSA PRIVATE KEY` or `BEGIN EC PRIVATE \
                 KEY` block"
                    .into()
            }
            other => format!("{other}"),
        },
    })?;
    Ok(pem)
}

impl TlsFiles {
    pub fn is_empty(&self) -> bool {
        self.cert.is_none() && self.key.is_none() && self.ca.is_none()
    }

    fn identity(&self) -> Result<Option<(Identity, PathBuf, PathBuf)>, TlsError> {
        match (&self.cert, &self.key) {
            (None, None) => Ok(None),
            (Some(cert), Some(key)) => {
                let c = read_certs("certificate", cert)?;
                let k = read_key(key)?;
                Ok(Some((Identity::from_pem(c, k), cert.clone(), key.clone())))
            }
            _ => Err(TlsError::Flags(
                "--tls-cert and --tls-key (tls.cert and tls.key) go together: give both or neither",
            )),
        }
    }

    /// The server side, `None` when no file is given. With `ca`, clients must present a
    /// certificate signed by it.
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        if self.is_empty() {
            return Ok(None);
        }
        let Some((identity, cert, key)) = self.identity()? else {
            return Err(TlsError::Flags(
                "--tls-ca without --tls-cert and --tls-key: a TLS server needs its own \
                 certificate and key",
            ));
        };
        let mut config = ServerTlsConfig::new().identity(identity);
        let mutual = match &self.ca {
            Some(ca) => {
                config = config.client_ca_root(Certificate::from_pem(read_certs("CA", ca)?));
                true
            }
            None => false,
        };
        Ok(Some(ServerTls {
            config,
            cert,
            key,
            mutual,
        }))
    }

    /// The client side, `None` when no file is given. Needs `ca` to verify servers;
    /// presents `cert`/`key` when given.
    pub fn client(&self) -> Result<Option<ClientTls>, TlsError> {
        if self.is_empty() {
            return Ok(None);
        }
        let identity = self.identity()?;
        let Some(ca) = &self.ca else {
            return Err(TlsError::Flags(
                "--tls-cert without --tls-ca: a TLS client needs the CA that signed the \
                 server's certificate",
            ));
        };
        let mut config =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read_certs("CA", ca)?));
        let presents_cert = identity.is_some();
        if let Some((id, _, _)) = identity {
            config = config.identity(id);
        }
        Ok(Some(ClientTls {
            config,
            presents_cert,
        }))
    }
}

/// A server's TLS settings, checked (files read, PEM parsed).
#[derive(Clone)]
pub struct ServerTls {
    config: ServerTlsConfig,
    cert: PathBuf,
    key: PathBuf,
    mutual: bool,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.cert)
            .field("mutual", &self.mutual)
            .finish()
    }
}

impl ServerTls {
    /// Whether clients must present a certificate.
    pub fn is_mutual(&self) -> bool {
        self.mutual
    }

    /// The certificate file, for logs.
    pub fn cert_path(&self) -> &Path {
        &self.cert
    }
}

/// A tonic server builder with `tls` applied (plaintext when `None`). Fails when the key
/// does not fit the certificate, naming both files.
pub fn server_builder(tls: Option<&ServerTls>) -> Result<tonic::transport::Server, TlsError> {
    let builder = tonic::transport::Server::builder();
    match tls {
        None => Ok(builder),
        Some(t) => builder
            .tls_config(t.config.clone())
            .map_err(|e| TlsError::Server {
                cert: t.cert.clone(),
                key: t.key.clone(),
                detail: error_chain(&e),
            }),
    }
}

/// A client's TLS settings, checked (files read, PEM parsed).
#[derive(Clone)]
pub struct ClientTls {
    config: ClientTlsConfig,
    presents_cert: bool,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("presents_cert", &self.presents_cert)
            .finish()
    }
}

/// An endpoint for `url`: `https://` with `tls`, `http://` without. A mismatch is an
/// error rather than a silent plaintext connection.
pub fn endpoint(url: &str, tls: Option<&ClientTls>) -> Result<Endpoint, TlsError> {
    let err = |detail: String| TlsError::Endpoint {
        endpoint: url.to_string(),
        detail,
    };
    let ep = Endpoint::from_shared(url.to_string())
        .map_err(|e| err(format!("not a valid endpoint address: {e}")))?;
    let https = ep.uri().scheme_str() == Some("https");
    match (tls, https) {
        (None, false) => Ok(ep),
        (None, true) => Err(err(
            "an https:// endpoint needs TLS settings (--tls-ca, and --tls-cert/--tls-key \
             when the server requires client certificates)"
                .into(),
        )),
        (Some(_), false) => Err(err(
            "TLS is configured but the endpoint is not https://: use https://".into(),
        )),
        (Some(t), true) => ep
            .tls_config(t.config.clone())
            .map_err(|e| err(error_chain(&e))),
    }
}

/// `e` and its sources, `: `-separated (tonic's errors keep the useful part in sources).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let t = s.to_string();
        if !out.contains(&t) {
            out.push_str(": ");
            out.push_str(&t);
        }
        src = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{AuthToken, ClientAuth, ServerAuth};
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    /// A CA that signs leaf certificates for 127.0.0.1 and localhost.
    struct Ca {
        issuer: Issuer<'static, KeyPair>,
        pem: String,
    }

    impl Ca {
        fn new(name: &str) -> Self {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().unwrap();
            let pem = params.self_signed(&key).unwrap().pem();
            Self {
                issuer: Issuer::new(params, key),
                pem,
            }
        }

        /// (certificate PEM, key PEM) of a leaf usable as server and as client.
        fn leaf(&self, name: &str) -> (String, String) {
            let mut params =
                CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                    .unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &self.issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        }

        /// Writes the CA and a leaf into `dir` as NAME.crt, NAME.key and ca-of-NAME.crt.
        fn files(&self, dir: &Path, name: &str) -> TlsFiles {
            let (cert, key) = self.leaf(name);
            let w = |file: String, text: &str| {
                let p = dir.join(file);
                std::fs::write(&p, text).unwrap();
                p
            };
            TlsFiles {
                cert: Some(w(format!("{name}.crt"), &cert)),
                key: Some(w(format!("{name}.key"), &key)),
                ca: Some(w(format!("ca-of-{name}.crt"), &self.pem)),
            }
        }
    }

    /// A health server behind `tls` and the token, on a loopback port; its address.
    async fn serve(tls: &ServerTls, token: &str) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (_, health) = tonic_health::server::health_reporter();
        let auth = ServerAuth::new(Some(AuthToken::new(token).unwrap()));
        let server = server_builder(Some(tls))
            .unwrap()
            .add_service(auth.intercept(health))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener));
        tokio::spawn(server);
        addr
    }

    /// One health check over `client`; the error as text.
    async fn check(url: &str, client: &ClientAuth) -> Result<(), String> {
        let channel = client
            .endpoint(url)
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| error_chain(&e))?;
        HealthClient::new(client.channel(channel))
            .check(HealthCheckRequest::default())
            .await
            .map(|_| ())
            .map_err(|s| format!("{:?}: {}", s.code(), error_chain(&s)))
    }

    const TOKEN: &str = "tls-test-token";

    fn client(files: &TlsFiles, token: Option<&str>) -> ClientAuth {
        let token = token.map(|t| AuthToken::new(t).unwrap());
        ClientAuth::new(token.as_ref()).with_tls(files.client().unwrap())
    }

    #[tokio::test]
    async fn mutual_tls_admits_only_clients_with_a_certificate_from_the_ca() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("deployment CA");
        let server_files = ca.files(dir.path(), "server");
        let tls = server_files.server().unwrap().unwrap();
        assert!(tls.is_mutual());
        let addr = serve(&tls, TOKEN).await;
        let https = format!("https://{addr}");

        // A certificate signed by the CA, and the token: admitted.
        let good = ca.files(dir.path(), "worker");
        check(&https, &client(&good, Some(TOKEN)))
            .await
            .expect("a client with a certificate from the CA is admitted");
        // TLS does not replace the token: the right certificate with a wrong token fails.
        let e = check(&https, &client(&good, Some("wrong")))
            .await
            .unwrap_err();
        assert!(e.starts_with("Unauthenticated"), "{e}");

        // No client certificate (trusting the server is not enough).
        let anonymous = TlsFiles {
            cert: None,
            key: None,
            ca: good.ca.clone(),
        };
        let e = check(&https, &client(&anonymous, Some(TOKEN)))
            .await
            .unwrap_err();
        // The alert (CertificateRequired) may or may not arrive before the connection
        // closes; either way the handler never ran.
        assert!(!e.starts_with("Unauthenticated"), "refused by TLS: {e}");

        // A certificate from another CA (which trusts the right server CA).
        let other = Ca::new("another CA").files(dir.path(), "stranger");
        let stranger = TlsFiles {
            ca: good.ca.clone(),
            ..other.clone()
        };
        let e = check(&https, &client(&stranger, Some(TOKEN)))
            .await
            .unwrap_err();
        assert!(!e.starts_with("Unauthenticated"), "refused by TLS: {e}");

        // A client that does not trust the server's CA refuses the server.
        let e = check(&https, &client(&other, Some(TOKEN)))
            .await
            .unwrap_err();
        assert!(e.to_lowercase().contains("certificate"), "{e}");

        // Plaintext to a TLS server.
        check(&format!("http://{addr}"), &ClientAuth::new(None))
            .await
            .unwrap_err();
        let plain = ClientAuth::new(Some(&AuthToken::new(TOKEN).unwrap()));
        check(&format!("http://{addr}"), &plain).await.unwrap_err();

        // And the good client still gets in after all of that.
        check(&https, &client(&good, Some(TOKEN))).await.unwrap();
    }

    #[tokio::test]
    async fn without_a_ca_the_server_takes_any_tls_client() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("deployment CA");
        let mut files = ca.files(dir.path(), "server");
        let ca_path = files.ca.take();
        let tls = files.server().unwrap().unwrap();
        assert!(!tls.is_mutual());
        let addr = serve(&tls, TOKEN).await;
        let verify_only = TlsFiles {
            cert: None,
            key: None,
            ca: ca_path,
        };
        check(
            &format!("https://{addr}"),
            &client(&verify_only, Some(TOKEN)),
        )
        .await
        .unwrap();
    }

    #[test]
    fn endpoint_scheme_must_match_the_tls_settings() {
        let dir = tempfile::tempdir().unwrap();
        let files = Ca::new("ca").files(dir.path(), "c");
        let tls = files.client().unwrap().unwrap();
        let e = endpoint("http://127.0.0.1:1", Some(&tls)).unwrap_err();
        assert!(e.to_string().contains("https://"), "{e}");
        let e = endpoint("https://127.0.0.1:1", None).unwrap_err();
        assert!(e.to_string().contains("--tls-ca"), "{e}");
        endpoint("https://127.0.0.1:1", Some(&tls)).unwrap();
        endpoint("http://127.0.0.1:1", None).unwrap();
    }

    #[test]
    fn errors_name_the_file_and_the_flags() {
        let dir = tempfile::tempdir().unwrap();
        let ca = Ca::new("ca");
        let good = ca.files(dir.path(), "s");
        let p = |n: &str| dir.path().join(n);

        let missing = TlsFiles {
            cert: Some(p("no-such.crt")),
            ..good.clone()
        };
        let e = missing.server().unwrap_err();
        assert!(
            matches!(e, TlsError::Read { .. }) && e.to_string().contains("no-such.crt"),
            "{e}"
        );

        std::fs::write(p("garbage.crt"), "not a certificate\n").unwrap();
        let e = TlsFiles {
            cert: Some(p("garbage.crt")),
            ..good.clone()
        }
        .server()
        .unwrap_err();
        assert!(e.to_string().contains("garbage.crt"), "{e}");
        let e = TlsFiles {
            ca: Some(p("garbage.crt")),
            ..good.clone()
        }
        .client()
        .unwrap_err();
        assert!(e.to_string().contains("garbage.crt"), "{e}");

        // A certificate where the key belongs, and a truncated certificate.
        let e = TlsFiles {
            key: good.cert.clone(),
            ..good.clone()
        }
        .server()
        .unwrap_err();
        assert!(
            e.to_string().contains("s.crt") && e.to_string().contains("key"),
            "{e}"
        );
        let text = std::fs::read_to_string(good.cert.as_ref().unwrap()).unwrap();
        std::fs::write(p("cut.crt"), &text[..text.len() / 2]).unwrap();
        let e = TlsFiles {
            cert: Some(p("cut.crt")),
            ..good.clone()
        }
        .server()
        .unwrap_err();
        assert!(e.to_string().contains("cut.crt"), "{e}");

        // A key that does not belong to the certificate: named when the server is built.
        let other = ca.files(dir.path(), "other");
        let tls = TlsFiles {
            key: other.key.clone(),
            ..good.clone()
        }
        .server()
        .unwrap()
        .unwrap();
        let e = server_builder(Some(&tls)).unwrap_err();
        assert!(
            e.to_string().contains("s.crt") && e.to_string().contains("other.key"),
            "{e}"
        );

        // Flag combinations.
        let half = TlsFiles {
            key: None,
            ..good.clone()
        };
        assert!(matches!(half.server(), Err(TlsError::Flags(_))));
        assert!(matches!(half.client(), Err(TlsError::Flags(_))));
        let ca_only = TlsFiles {
            cert: None,
            key: None,
            ca: good.ca.clone(),
        };
        assert!(matches!(ca_only.server(), Err(TlsError::Flags(_))));
        assert!(ca_only.client().unwrap().is_some());
        let no_ca = TlsFiles {
            ca: None,
            ..good.clone()
        };
        assert!(matches!(no_ca.client(), Err(TlsError::Flags(_))));
        assert!(TlsFiles::default().server().unwrap().is_none());
        assert!(TlsFiles::default().client().unwrap().is_none());
    }
}
