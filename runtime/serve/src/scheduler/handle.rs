//! A scheduler on a thread of its own, fed through a channel: what the HTTP server talks to.

use super::request::{Event, EventSender, Request};
use super::state::Scheduler;

/// What the scheduler thread is told.
enum Command {
    Submit(Request, EventSender),
}

/// A scheduler running on its own thread; requests reach it through [`SchedulerHandle::submit`].
/// Dropping every handle stops the thread once its requests are done.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: std::sync::mpsc::Sender<Command>,
    broken: std::sync::Arc<std::sync::OnceLock<String>>,
}

impl SchedulerHandle {
    /// Runs `scheduler` on a new thread.
    pub fn spawn(mut scheduler: Scheduler) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel::<Command>();
        // (Behind a lock: the loop's turns take requests on whichever thread has the turn.)
        let rx = std::sync::Mutex::new(rx);
        let broken = scheduler.broken.clone();
        std::thread::Builder::new()
            .name("maxc-scheduler".into())
            .spawn(move || loop {
                if !scheduler.has_work() {
                    match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                        Ok(Command::Submit(r, e)) => scheduler.submit(r, e),
                        Err(_) => return,
                    }
                }
                while let Ok(Command::Submit(r, e)) =
                    rx.lock().unwrap_or_else(|e| e.into_inner()).try_recv()
                {
                    scheduler.submit(r, e);
                }
                if scheduler.loops() {
                    // Decode steps go on on whichever of the executor's threads has a CPU;
                    // requests are taken between them.
                    scheduler.run_loop(&mut |s| {
                        let rx = rx.lock().unwrap_or_else(|e| e.into_inner());
                        while let Ok(Command::Submit(r, e)) = rx.try_recv() {
                            s.submit(r, e);
                        }
                        true
                    });
                    continue;
                }
                scheduler.step();
            })?;
        Ok(SchedulerHandle { tx, broken })
    }

    /// Why the scheduler's executor can run no more steps (the ranks of its group failed),
    /// once it cannot.
    pub fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    /// Queues `req`; its events arrive on the returned receiver, and dropping the receiver
    /// cancels it.
    pub fn submit(&self, req: Request) -> tokio::sync::mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        if let Err(std::sync::mpsc::SendError(Command::Submit(_, events))) =
            self.tx.send(Command::Submit(req, tx))
        {
            let _ = events.send(Event::Error("the scheduler has stopped".into()));
        }
        rx
    }
}
