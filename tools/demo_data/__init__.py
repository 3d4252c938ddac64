"""The offline demo data generator (fact tables + builder)."""
