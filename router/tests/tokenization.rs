//! The tokenization cache against full tokenization, with the tokenizer the
//! project ships (`deploy/tokenizer`, a byte-level BPE): conversations
//! rendered through its ChatML template turn by turn, and text prompts that
//! extend earlier ones anywhere (mid-word, mid-character, inside a special
//! token's text), must give exactly the ids of tokenizing the whole text.

use proptest::prelude::*;
use router::service::chat_template::{ChatTemplate, Message};
use router::service::text::Text;
use router::service::token_cache::Outcome;

const PIECES: &[&str] = &[
    "hello",
    " world",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "café",
    " naïve",
    "日本語",
    " 🎉",
    "12345",
    " 7",
    "it's",
    " don't",
    ".",
    "!\n",
    " <|im_start|>",
    "<|im_end|>",
    "<|im_",
    "end|>",
    " ",
    "   x",
    "Ünïcödé",
    "—",
    " quotes \"",
    "()",
    " the",
    " cost",
    "of",
    " apples,",
    "\r\n",
];

fn words(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(PIECES), 1..max).prop_map(|w| w.concat())
}

/// Loaded once (a 128k-token vocabulary takes a while in a debug build);
/// the cache is shared by every case, as a router's is by its requests.
fn texts() -> &'static (Text, Text, ChatTemplate) {
    static TEXTS: std::sync::LazyLock<(Text, Text, ChatTemplate)> = std::sync::LazyLock::new(load);
    &TEXTS
}

fn load() -> (Text, Text, ChatTemplate) {
    let path = tests::tokenizer::shipped();
    let cached = Text::load(&path, 64 << 20).expect("the shipped tokenizer");
    assert!(
        cached.cached(),
        "the shipped tokenizer passes the cache's probe"
    );
    let plain = Text::load(&path, 0).expect("the shipped tokenizer");
    let template =
        ChatTemplate::from_tokenizer_config(&path.with_file_name("tokenizer_config.json"))
            .expect("its config")
            .expect("its chat template");
    (cached, plain, template)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn conversations_tokenize_as_a_whole(
        system in words(80),
        turns in prop::collection::vec((words(120), words(200)), 1..6),
    ) {
        let (cached, plain, template) = texts();
        let mut messages = vec![Message { role: "system".into(), content: system }];
        for (user, answer) in turns {
            messages.push(Message { role: "user".into(), content: user });
            let rendered = template.render(&messages).unwrap();
            let got = cached.encode_rendered(&rendered).unwrap();
            let want = plain.encode_rendered(&rendered).unwrap();
            prop_assert_eq!(&got.ids, &want.ids);
            messages.push(Message { role: "assistant".into(), content: answer });
        }
    }

    #[test]
    fn a_text_extending_another_anywhere_tokenizes_as_a_whole(
        base in words(400),
        suffixes in prop::collection::vec(words(60), 1..5),
        cut in 0usize..64,
    ) {
        let (cached, plain, _) = texts();
        let mut text = base;
        cached.encode(&text).unwrap();
        for suffix in suffixes {
            // Sometimes cut the earlier text short (a branch), at any byte
            // that is a character boundary.
            let mut at = text.len().saturating_sub(cut);
            while !text.is_char_boundary(at) {
                at -= 1;
            }
            let next = format!("{}{suffix}", &text[..at]);
            let got = cached.encode(&next).unwrap();
            prop_assert_eq!(&got.ids, &plain.encode(&next).unwrap().ids);
            text = next;
        }
    }
}

/// A long conversation's later turns reuse nearly all of its earlier ones.
#[test]
fn later_turns_reuse_the_earlier_ones() {
    let (cached, plain, template) = texts();
    let mut messages = vec![Message {
        role: "system".into(),
        content: "You are a careful coding agent.".into(),
    }];
    let mut last = 0;
    for i in 0..6 {
        messages.push(Message {
            role: "user".into(),
            content: format!("step {i}: ")
                + &"read the file and fix the failing test. ".repeat(200),
        });
        let rendered = template.render(&messages).unwrap();
        let got = cached.encode_rendered(&rendered).unwrap();
        assert_eq!(got.ids, plain.encode_rendered(&rendered).unwrap().ids);
        if i > 0 {
            assert_eq!(got.outcome, Outcome::Prefix);
            assert!(
                got.reused + 64 >= last,
                "reused {} of the earlier {last}",
                got.reused
            );
        }
        last = got.ids.len();
        messages.push(Message {
            role: "assistant".into(),
            content: format!("done {i}. ") + &"patched the code and ran it. ".repeat(50),
        });
    }
    assert!(cached.cache_bytes() > 0);
}
