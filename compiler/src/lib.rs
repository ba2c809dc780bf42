//! The Llama frontend and the compiler driver.
