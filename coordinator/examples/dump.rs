fn main() {
    let p = std::env::args().nth(1).unwrap();
    let (evs, _) = tutor_coordinator::store::scan(std::path::Path::new(&p)).unwrap();
    for e in evs {
        if let Some(tutor_proto::episode_event::Event::Turn(t)) = e.event {
            if e.episode_id.contains("eval") || t.executed == 2 {
                println!(
                    "{} t{} exec={} to={} rc={} cmd={:?}",
                    e.episode_id,
                    t.turn_index,
                    t.executed,
                    t.timed_out,
                    t.exit_code,
                    t.command.chars().take(80).collect::<String>()
                );
            }
        }
    }
}
