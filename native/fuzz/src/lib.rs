//! Shared by the fuzz targets: a panic is a crash libFuzzer records (panic = "abort" in the
//! profile), and the allow-list table is the reader's real one (`table.txt`, written by
//! `run.sh` from `ckptfix.pickling.reader.native_table()`).

/// The reader's allow-list table as the Python engine hands it to the VM.
pub const TABLE: &[u8] = include_bytes!("../table.txt");
