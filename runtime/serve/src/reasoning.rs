//! A thinking model's output split into its reasoning (`<think>` ... `</think>`, as Qwen 3 and
//! DeepSeek-R1's distills write it) and its answer, piece by piece as it streams: the reasoning
//! goes to `reasoning_content`, the rest to `content`. A tag cut between two pieces is held back
//! until it is whole.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where a streamed output is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasoningSplit {
    /// Inside the thinking section.
    inside: bool,
    /// Whether the start was read (an opening tag, or text that is not one).
    decided: bool,
    /// Text held back: a possible tag, not yet whole.
    held: String,
    /// The section just closed: blanks before the answer are dropped.
    after_close: bool,
}

/// One piece split: its reasoning and its answer text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Text of the thinking section.
    pub reasoning: String,
    /// Text of the answer.
    pub content: String,
}

impl ReasoningSplit {
    /// A split of an output whose prompt ended inside a thinking section (`in_reasoning`: the
    /// template opened `<think>` itself, as DeepSeek-R1's does) or not (the model may open one
    /// first thing).
    pub fn new(in_reasoning: bool) -> Self {
        ReasoningSplit {
            inside: in_reasoning,
            decided: in_reasoning,
            held: String::new(),
            after_close: false,
        }
    }

    /// The next `piece` of output, split.
    pub fn push(&mut self, piece: &str) -> Split {
        self.held.push_str(piece);
        let mut out = Split::default();
        loop {
            if !self.decided {
                let t = self.held.trim_start();
                if let Some(rest) = t.strip_prefix(OPEN) {
                    self.held = rest.to_string();
                    self.inside = true;
                    self.decided = true;
                } else if OPEN.starts_with(t) {
                    return out; // maybe an opening tag: wait
                } else {
                    self.decided = true;
                }
                continue;
            }
            if !self.inside {
                if self.after_close {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = t.to_string();
                    self.after_close = false;
                }
                out.content.push_str(&std::mem::take(&mut self.held));
                return out;
            }
            if let Some(i) = self.held.find(CLOSE) {
                out.reasoning.push_str(&self.held[..i]);
                let rest = self.held[i + CLOSE.len()..].to_string();
                self.held = rest;
                self.inside = false;
                self.after_close = true;
                continue;
            }
            // Hold back what may be the start of a closing tag.
            let keep = (1..CLOSE.len())
                .rev()
                .find(|&k| self.held.ends_with(&CLOSE[..k]))
                .unwrap_or(0);
            let cut = self.held.len() - keep;
            out.reasoning.push_str(&self.held[..cut]);
            self.held.drain(..cut);
            return out;
        }
    }

    /// What is still held at the end, split.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        if self.inside {
            Split {
                reasoning: held,
                content: String::new(),
            }
        } else {
            Split {
                reasoning: String::new(),
                content: held,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(in_reasoning: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplit::new(in_reasoning);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let out = s.push(p);
            r.push_str(&out.reasoning);
            c.push_str(&out.content);
        }
        let out = s.finish();
        (r + &out.reasoning, c + &out.content)
    }

    #[test]
    fn tags_split_wherever_the_pieces_cut_them() {
        let text = "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.";
        let want = (
            "\nLet me add 2 and 2.\n".to_string(),
            "The answer is 4.".to_string(),
        );
        for size in 1..=text.len() {
            let pieces: Vec<String> = text
                .as_bytes()
                .chunks(size)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect();
            let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(run(false, &refs), want, "pieces of {size}");
        }
    }

    #[test]
    fn a_prompt_that_opened_the_section_and_text_without_one() {
        assert_eq!(
            run(true, &["Hmm, ", "so </th", "ink>Yes."]),
            ("Hmm, so ".into(), "Yes.".into())
        );
        assert_eq!(
            run(false, &["<th", "is is not a tag"]),
            (String::new(), "<this is not a tag".into())
        );
        assert_eq!(
            run(false, &["Plain answer."]),
            (String::new(), "Plain answer.".into())
        );
        // Cut off inside the section: all of it is reasoning.
        assert_eq!(
            run(false, &["<think>still thinking"]),
            ("still thinking".into(), String::new())
        );
    }
}
