//! The tokenizer's streaming decode (and whole decode) of any id sequence, in or out of the
//! vocabulary, as the server streams text.
#![no_main]
use libfuzzer_sys::fuzz_target;
use maxc_serve::tokenizer::Tokenizer;
use std::sync::OnceLock;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_file(&maxc_fuzz::template().join("tokenizer.json"))
            .expect("the template artifact has a tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let t = tokenizer();
    let ids: Vec<u32> = rest
        .chunks(2)
        .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
        .collect();
    let mut stream = t.decode_stream(flags & 1 == 1);
    for &id in &ids {
        let _ = stream.push(id);
    }
    let _ = stream.flush();
    let _ = t.decode(&ids, flags & 2 == 2);
});
