//! End-to-end tests live in tests/tests/*.rs and drive the `kiln` binary.
