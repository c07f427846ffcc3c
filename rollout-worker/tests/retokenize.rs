//! Token-in/token-out: the ids a student generated are what it is trained on. A model can
//! sample a non-canonical BPE split of a text (here "hello" as single-byte tokens instead
//! of the merged token the tokenizer produces); decoding and encoding again would change
//! those ids, so the history and the training examples must carry the generated ids
//! themselves. This builds an episode's turns the way `run_episode` does (prompt delta,
//! the student's ids + the turn end, observation delta) and checks what the coordinator's
//! dataset builders make of them.

use tutor_coordinator::dataset::{policy_gradient_example, rft_examples};
use tutor_policy::ChatTokenizer;
use tutor_proto::{Actor, TurnRecord};

fn tokenizer() -> ChatTokenizer {
    let corpus: Vec<String> = (0..20)
        .map(|i| format!("hello world {i}: hello there, hello again\n"))
        .collect();
    ChatTokenizer::train(&corpus, 400).unwrap()
}

#[test]
fn generated_ids_survive_where_retokenizing_would_change_them() {
    let tok = tokenizer();
    let text = "hello";
    let canonical = tok.encode(text);
    // The same text one character per token: a split the model may sample.
    let split: Vec<u32> = text
        .chars()
        .flat_map(|c| tok.encode(&c.to_string()))
        .collect();
    assert_eq!(tok.decode(&split), text);
    assert!(
        canonical.len() < split.len(),
        "the corpus should have merged {text:?}: {canonical:?}"
    );
    // Re-tokenizing the decoded generation would change the ids.
    assert_ne!(tok.encode(&tok.decode(&split)), split);

    let mut generated = split.clone();
    generated.push(tok.turn_end_id());
    let logprobs: Vec<f32> = (0..generated.len())
        .map(|i| -0.1 * (i + 1) as f32)
        .collect();
    let prompt = tok.render_prompt("sys", "say hello").unwrap();
    let observation = tok.render_observation("ok").unwrap();
    let turns = vec![
        TurnRecord {
            turn_index: 0,
            context_delta_tokens: prompt.clone(),
            teacher_tokens: tok.encode_assistant(text),
            student_tokens: generated.clone(),
            student_logprobs: logprobs.clone(),
            executed: Actor::Student as i32,
            ..Default::default()
        },
        TurnRecord {
            turn_index: 1,
            context_delta_tokens: observation.clone(),
            teacher_tokens: tok.encode_assistant("bye"),
            student_tokens: tok.encode_assistant("bye"),
            student_logprobs: vec![-0.5; 2],
            executed: Actor::Teacher as i32,
            ..Default::default()
        },
    ];
    let expected: Vec<u32> = [
        prompt.as_slice(),
        &generated,
        &observation,
        &tok.encode_assistant("bye"),
    ]
    .concat();

    let rft = rft_examples("e", &turns, true, 4096);
    assert_eq!(rft.len(), 1);
    assert_eq!(rft[0].tokens, expected);
    // The generated ids are labels, as generated.
    let start = prompt.len();
    assert!(rft[0].loss_mask[start..start + generated.len()]
        .iter()
        .all(|&m| m));
    assert!(!rft[0].loss_mask[..start].iter().any(|&m| m));

    let pg = policy_gradient_example("e", &turns, 4096, true).unwrap();
    assert_eq!(pg.tokens, expected);
    assert_eq!(
        pg.old_logprobs[start..start + generated.len()],
        logprobs[..]
    );

    // What a re-tokenizing pipeline would have trained on instead: other ids.
    let retokenized: Vec<u32> = [
        prompt.as_slice(),
        &tok.encode_assistant(&tok.decode(&split)),
        &observation,
        &tok.encode_assistant("bye"),
    ]
    .concat();
    assert_ne!(retokenized, rft[0].tokens);
}
