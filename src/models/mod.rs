//! Model graphs defined with graft's public graph API.
