"""Test support: synthetic target/draft pairs with a chosen acceptance, at any size."""
