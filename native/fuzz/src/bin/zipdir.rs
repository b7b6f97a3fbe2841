//! libFuzzer target: the native zip directory reader over an arbitrary "file". It must give
//! the records, a one-line refusal, or "leave it to Python" -- never panic or overflow -- and
//! every record it returns must lie inside the file.
#![no_main]

use ckptfix_native::zip::read_directory;

/// # Safety
/// libFuzzer's contract: `data` is valid for reads of `size` bytes during the call.
#[no_mangle]
pub unsafe extern "C" fn LLVMFuzzerTestOneInput(data: *const u8, size: usize) -> i32 {
    // SAFETY: libFuzzer passes a buffer valid for `size` bytes for the duration of the call.
    let input: &[u8] = if size == 0 {
        &[]
    } else {
        unsafe { std::slice::from_raw_parts(data, size) }
    };
    if let Ok(directory) = read_directory(input, input.len() as u64) {
        for i in 0..directory.len() {
            let end = directory.data_offset[i].checked_add(directory.compressed_size[i]);
            assert!(
                end.is_some_and(|end| end <= input.len() as u64),
                "record {i} lies outside the file"
            );
            assert!(
                directory.header_offset[i] < directory.data_offset[i],
                "record {i} has no header"
            );
        }
        let _ = directory.encode();
    }
    0
}
