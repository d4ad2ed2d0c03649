//! Kernel generators and the catalog of every configuration the dispatch can choose.

pub mod attention;
