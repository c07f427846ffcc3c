//! The weights broadcast in one process: learner rank 0's broadcaster, the coordinator's
//! rendezvous service on a real socket, one real receiver thread and one receiver the
//! test drives by hand. Every published version reaches the receivers byte for byte;
//! when a receiver dies the broadcaster forms the group again, and a receiver that comes
//! back gets the newest version at once.

use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tutor_collective::broadcast::{
    spawn_broadcaster, spawn_receiver, Arrived, ReceiverEvent, GROUP, RECEIVE_TIMEOUT,
};
use tutor_collective::rendezvous::{fetch, GroupOptions};
use tutor_collective::{Collective, CpuCollective, CpuCollectiveTimeouts};
use tutor_learner::{CollectiveChoice, WeightsStore};
use tutor_proto::auth::ClientAuth;

fn options(coordinator: &str, rank: usize, world_size: usize) -> GroupOptions {
    GroupOptions {
        rank,
        world_size,
        collective: CollectiveChoice::Cpu,
        coordinator: coordinator.into(),
        auth: ClientAuth::new(None),
        collective_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        collective_advertise: None,
        gpu: 0,
        rendezvous_timeout: Duration::from_secs(20),
        collective_timeout: RECEIVE_TIMEOUT,
        group: GROUP.into(),
    }
}

/// Writes version `v` (distinct bytes) into the store and registers it.
fn publish(store: &WeightsStore, v: u64) -> String {
    let bytes: Vec<u8> = (0..50_000u32)
        .map(|i| (i * 7 + v as u32 * 13) as u8)
        .collect();
    std::fs::write(store.path_for(v), &bytes).unwrap();
    let pv = store.register(v).unwrap();
    assert_eq!(pv.sha256, hex::encode(Sha256::digest(&bytes)));
    pv.sha256
}

/// The next version message on a hand-driven receiver (keepalives skipped).
fn next_version(c: &mut dyn Collective) -> (u64, Vec<u8>) {
    loop {
        let mut header = Vec::new();
        c.broadcast_bytes(&mut header).unwrap();
        let h: serde_json::Value = serde_json::from_slice(&header).unwrap();
        if let Some(v) = h["version"].as_u64() {
            let mut data = Vec::new();
            c.broadcast_bytes(&mut data).unwrap();
            assert_eq!(data.len() as u64, h["bytes"].as_u64().unwrap());
            return (v, data);
        }
    }
}

fn wait_for(rx: &mpsc::Receiver<Arrived>, version: u64) -> Arrived {
    loop {
        let a = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("version {version} never arrived"));
        if a.version == version {
            return a;
        }
    }
}

#[test]
fn versions_reach_receivers_and_the_group_forms_again_after_a_receiver_dies() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let coordinator = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(tutor_proto::learner_group_server::LearnerGroupServer::new(
                tutor_coordinator::learner_group::LearnerGroupService::default(),
            ))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    let dir = tempfile::tempdir().unwrap();
    let store = WeightsStore::new(&dir.path().join("versions")).unwrap();
    let sha0 = publish(&store, 0);
    let stop = Arc::new(AtomicBool::new(false));
    spawn_broadcaster(
        options(&coordinator, 0, 3),
        {
            let store = store.clone();
            move || store.latest()
        },
        rt.handle().clone(),
        stop.clone(),
    )
    .unwrap();
    let (tx, rx) = mpsc::channel();
    spawn_receiver(
        options(&coordinator, 1, 0),
        rt.handle().clone(),
        move |e| match e {
            ReceiverEvent::Arrived(a) => tx.send(a).unwrap(),
            ReceiverEvent::Joined { .. } | ReceiverEvent::Left => {}
        },
    )
    .unwrap();

    // Receiver 2, by hand.
    let timeouts = CpuCollectiveTimeouts {
        connect: Duration::from_secs(20),
        io: Duration::from_secs(60),
    };
    let join = |after: u64| {
        let rdv = rt
            .block_on(fetch(&options(&coordinator, 2, 3), after))
            .unwrap();
        assert_eq!(rdv.world_size, 3);
        let c = CpuCollective::connect(rdv.cpu_address.as_str(), 2, 3, timeouts).unwrap();
        (c, rdv.generation)
    };
    let (mut second, first_generation) = join(0);
    let (v, data) = next_version(&mut second);
    assert_eq!(
        v, 0,
        "the newest version goes out as soon as the group forms"
    );
    assert_eq!(hex::encode(Sha256::digest(&data)), sha0);
    let got = wait_for(&rx, 0);
    assert_eq!(got.sha256, sha0);
    assert_eq!(*got.bytes, std::fs::read(store.path_for(0)).unwrap());

    let sha1 = publish(&store, 1);
    assert_eq!(
        next_version(&mut second),
        (1, std::fs::read(store.path_for(1)).unwrap())
    );
    assert_eq!(wait_for(&rx, 1).sha256, sha1);

    // Receiver 2 dies. The broadcaster notices at its next message (a keepalive at the
    // latest), forms a new generation, and the restarted receiver 2 and the surviving
    // receiver 1 both join it and get the newest version (1) at once.
    drop(second);
    let (mut second, generation) = join(first_generation);
    assert!(generation > first_generation);
    assert_eq!(next_version(&mut second).0, 1);
    assert_eq!(wait_for(&rx, 1).sha256, sha1, "receiver 1 rejoined too");
    let sha2 = publish(&store, 2);
    assert_eq!(next_version(&mut second).0, 2);
    let got = wait_for(&rx, 2);
    assert_eq!(got.sha256, sha2);
    assert_eq!(*got.bytes, std::fs::read(store.path_for(2)).unwrap());
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
}
