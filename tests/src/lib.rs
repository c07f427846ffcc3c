//! Cross-process tests live in tests/tests/; they drive the `tutor` binary.
