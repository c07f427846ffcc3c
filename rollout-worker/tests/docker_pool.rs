//! The warm container pool against the real engine: an episode takes a pre-created
//! container, the pool refills, shutting it down (or dropping it) leaves no container,
//! a container killed behind its back is replaced rather than handed out, and the
//! worker's factory uses it only when configured. Needs the image from `make images`;
//! skips (saying so) only when no Docker engine is reachable.

use std::collections::HashMap;
use std::time::Duration;

use tutor_rollout_worker::sandbox::docker::{
    self, ContainerSpec, LABEL_EPISODE, LABEL_RUN, LABEL_WORKER,
};
use tutor_rollout_worker::sandbox::pool::{WarmPool, LABEL_POOL};
use tutor_rollout_worker::sandbox::SandboxFactory;
use tutor_rollout_worker::worker::{SandboxKind, WorkerConfig};

const IMAGE: &str = "tutor/python-task:latest";
const WORKER: &str = "test-worker";
/// Bound on waiting for the pool to fill (containers start in about a second each;
/// this is for a loaded machine).
const FILL: Duration = Duration::from_secs(180);

async fn engine() -> Option<bollard::Docker> {
    match docker::connect().await {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("SKIPPED: no Docker engine reachable: {e}");
            None
        }
    }
}

fn task() -> tutor_rollout_worker::tasks::TaskRecord {
    tutor_rollout_worker::toy::generate(1, 11).remove(0)
}

fn spec(run: &str, episode: &str) -> ContainerSpec {
    ContainerSpec::new(IMAGE, run, WORKER, episode)
}

/// Ids and labels of the containers (running or not) labelled with `run`.
async fn containers_of(d: &bollard::Docker, run: &str) -> HashMap<String, HashMap<String, String>> {
    let filters = HashMap::from([("label".to_string(), vec![format!("{LABEL_RUN}={run}")])]);
    d.list_containers(Some(
        bollard::query_parameters::ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build(),
    ))
    .await
    .unwrap()
    .into_iter()
    .map(|c| (c.id.unwrap_or_default(), c.labels.unwrap_or_default()))
    .collect()
}

/// Polls (bounded) until no container of `run` is left; returns how many are.
async fn wait_gone(d: &bollard::Docker, run: &str) -> usize {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n = containers_of(d, run).await.len();
        if n == 0 || std::time::Instant::now() > end {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_episode_takes_a_warm_container_and_the_pool_refills() {
    let Some(d) = engine().await else { return };
    let run = format!("test-pool-take-{}", std::process::id());
    let pool = WarmPool::start(&d, &spec(&run, ""), 2);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 2, "the pool fills to 2");
    let warm = pool.ready(IMAGE).await;
    // Pooled containers carry run, worker and pool labels, and no episode yet.
    let listed = containers_of(&d, &run).await;
    assert_eq!(listed.len(), 2);
    for id in &warm {
        let labels = &listed[id];
        assert_eq!(labels[LABEL_RUN], run);
        assert_eq!(labels[LABEL_WORKER], WORKER);
        assert_eq!(labels[LABEL_POOL], pool.name());
        assert!(!labels.contains_key(LABEL_EPISODE), "{labels:?}");
    }

    let mut sb = pool.acquire(&spec(&run, "e1"), &task()).await.unwrap();
    assert!(sb.pooled());
    assert!(
        warm.contains(&sb.id().to_string()),
        "the episode got a pre-created container: {} not in {warm:?}",
        sb.id()
    );
    // Set up for the task exactly as a fresh one: files committed as the base, shell in
    // /testbed as the unprivileged user.
    assert_eq!(sb.base_commit().len(), 40);
    let out = sb
        .run(
            "pwd; id -u; git status --porcelain | wc -l; ls tests | head -1",
            Duration::from_secs(20),
        )
        .await;
    assert_eq!(out.exit_code, 0, "{}", out.output);
    let lines: Vec<&str> = out.output.lines().collect();
    assert_eq!(&lines[..3], ["/testbed", "1000", "0"], "{}", out.output);
    assert!(lines[3].starts_with("test_"), "{}", out.output);
    sb.run("echo '# edit' >> README.md", Duration::from_secs(20))
        .await;
    assert!(sb.diff().await.contains("+# edit"));

    // The pool refills to 2 in the background, with new containers.
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 2, "the pool refills");
    let refilled = pool.ready(IMAGE).await;
    assert!(!refilled.contains(&sb.id().to_string()));
    assert_eq!(containers_of(&d, &run).await.len(), 3);

    pool.shutdown().await;
    let left: Vec<String> = containers_of(&d, &run).await.into_keys().collect();
    assert_eq!(
        left,
        vec![sb.id().to_string()],
        "only the episode's container is left"
    );
    sb.remove().await;
    assert_eq!(containers_of(&d, &run).await.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutting_down_or_dropping_the_pool_leaves_no_container() {
    let Some(d) = engine().await else { return };
    // Shut down while containers are still being created: they are removed too.
    let run = format!("test-pool-stop-{}", std::process::id());
    let pool = WarmPool::start(&d, &spec(&run, ""), 2);
    pool.warm(IMAGE).await;
    pool.shutdown().await;
    assert_eq!(containers_of(&d, &run).await.len(), 0);
    // A shut-down pool still gives sandboxes, created on demand.
    let mut sb = pool.acquire(&spec(&run, "e1"), &task()).await.unwrap();
    assert!(!sb.pooled());
    assert_eq!(
        containers_of(&d, &run).await[sb.id()][LABEL_EPISODE],
        "e1",
        "an on-demand container has its episode label"
    );
    sb.remove().await;

    // Shut down when full.
    let pool = WarmPool::start(&d, &spec(&run, ""), 2);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 2);
    assert_eq!(containers_of(&d, &run).await.len(), 2);
    pool.shutdown().await;
    assert_eq!(containers_of(&d, &run).await.len(), 0);

    // Dropping every handle removes the containers too (in the background).
    let pool = WarmPool::start(&d, &spec(&run, ""), 1);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
    let clone = pool.clone();
    drop(pool);
    drop(clone);
    assert_eq!(wait_gone(&d, &run).await, 0);

    // What a killed worker leaves (a pool never shut down) is an orphan of its run and
    // worker, removed by the next worker's start-up sweep.
    let pool = WarmPool::start(&d, &spec(&run, ""), 1);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
    let removed = docker::remove_orphans(&d, &run, Some(WORKER))
        .await
        .unwrap();
    assert_eq!(removed, 1);
    pool.shutdown().await;
    assert_eq!(containers_of(&d, &run).await.len(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_container_killed_behind_the_pools_back_is_replaced_not_handed_out() {
    let Some(d) = engine().await else { return };
    let run = format!("test-pool-killed-{}", std::process::id());
    let pool = WarmPool::start(&d, &spec(&run, ""), 1);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
    let killed = pool.ready(IMAGE).await.remove(0);
    d.kill_container(
        &killed,
        None::<bollard::query_parameters::KillContainerOptions>,
    )
    .await
    .unwrap();

    let mut sb = pool.acquire(&spec(&run, "e1"), &task()).await.unwrap();
    assert_ne!(sb.id(), killed, "the killed container was handed out");
    let out = sb.run("echo alive", Duration::from_secs(20)).await;
    assert_eq!(out.output.trim(), "alive");
    // The dead one is gone and the pool is full again with a live one.
    assert!(
        !containers_of(&d, &run).await.contains_key(&killed),
        "the killed container was not removed"
    );
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
    let fresh = pool.ready(IMAGE).await;
    assert!(!fresh.contains(&killed) && !fresh.contains(&sb.id().to_string()));
    sb.remove().await;
    pool.shutdown().await;
    assert_eq!(containers_of(&d, &run).await.len(), 0);
}

/// The worker's wiring: `warm_pool = 0` creates every container on demand with its
/// episode label (as before the pool existed); `warm_pool = 1` hands out pooled ones,
/// and the factory's shutdown removes the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_factory_uses_the_pool_only_when_configured() {
    let Some(d) = engine().await else { return };
    let run = format!("test-pool-factory-{}", std::process::id());
    for size in [0u32, 1] {
        let config = WorkerConfig {
            sandbox: SandboxKind::Docker,
            image: IMAGE.into(),
            warm_pool: size,
            ..Default::default()
        };
        let factory = config.sandboxes(&run, WORKER).await.unwrap();
        let SandboxFactory::Docker(settings) = &factory else {
            panic!("a Docker factory")
        };
        assert_eq!(settings.pool.is_some(), size > 0);
        let warm = match &settings.pool {
            Some(pool) => {
                assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
                pool.ready(IMAGE).await
            }
            None => Vec::new(),
        };
        let (short_id, sb) = tokio::task::spawn_blocking({
            let factory = factory.clone();
            move || {
                let mut sb = factory.create(&task(), "ep-1").unwrap();
                // A container's hostname is its short id.
                let out = sb.run("hostname", Duration::from_secs(20));
                (out.output.trim().to_string(), sb)
            }
        })
        .await
        .unwrap();
        assert_eq!(short_id.len(), 12, "{short_id:?}");
        let listed = containers_of(&d, &run).await;
        let (id, labels) = listed
            .iter()
            .find(|(id, _)| id.starts_with(&short_id))
            .expect("the sandbox's container is labelled with the run");
        assert_eq!(warm.contains(id), size > 0, "size {size}: {id} vs {warm:?}");
        if size == 0 {
            assert_eq!(labels[LABEL_EPISODE], "ep-1");
            assert!(!labels.contains_key(LABEL_POOL));
            assert_eq!(listed.len(), 1);
        } else {
            assert_eq!(labels[LABEL_POOL], settings.pool.as_ref().unwrap().name());
        }
        drop(sb);
        factory.shutdown().await;
        assert_eq!(containers_of(&d, &run).await.len(), 0, "size {size}");
    }
}

/// A warm container has the pool's limits, read-only root and tmpfs quota included, and
/// an episode that asks for other limits (here another disk quota) gets a container made
/// for it, not a warm one with the wrong quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_container_has_the_pools_limits_and_other_limits_get_their_own() {
    let Some(d) = engine().await else { return };
    let run = format!("test-pool-limits-{}", std::process::id());
    let pool = WarmPool::start(&d, &spec(&run, ""), 1);
    pool.warm(IMAGE).await;
    assert_eq!(pool.wait_ready(IMAGE, FILL).await, 1);
    let warm = pool.ready(IMAGE).await;

    let mut other = spec(&run, "e1");
    other.disk_bytes = 64 << 20;
    let mut sb = pool.acquire(&other, &task()).await.unwrap();
    assert!(
        !sb.pooled(),
        "a warm container with another quota was handed out"
    );
    assert!(!warm.contains(&sb.id().to_string()));
    let t = Duration::from_secs(20);
    let out = sb.run("df -B1 --output=size /testbed | tail -1", t).await;
    assert_eq!(out.output.trim(), (64u64 << 20).to_string(), "{out:?}");
    sb.remove().await;

    let mut sb = pool.acquire(&spec(&run, "e2"), &task()).await.unwrap();
    assert!(sb.pooled());
    let out = sb
        .run(
            "df -B1 --output=size /testbed | tail -1; ulimit -n; (echo x > /home/agent/x) 2>&1 | sed 's/.*: //'; git status --porcelain | wc -l",
            t,
        )
        .await;
    assert_eq!(
        out.output,
        format!("{}\n1024\nRead-only file system\n0\n", 1u64 << 30),
        "{out:?}"
    );
    sb.remove().await;
    pool.shutdown().await;
    assert_eq!(wait_gone(&d, &run).await, 0);
}
